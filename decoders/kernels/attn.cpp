// vidspec: attention of a few query rows (decode, verify, draft) over a long KV cache, in one pass.
//
// For each KV head, the keys are streamed in blocks of BK: scores of every query row of that head's GQA
// group against the block (register-tiled: R rows x NV key vectors of accumulators), then an online
// softmax (running max and sum per row; earlier output rescaled when the max grows), then P @ V into the
// rows' accumulators. K and V are read once per head whatever the number of rows, and no score matrix over
// the whole cache is ever written. Layouts are those of decoders.cache on CPU: keys stored transposed
// ([head][d][entry], entry stride 1), values [head][entry][d] (d stride 1).
// Portable C++ with GCC vector extensions (16 floats): AVX-512 where -march=native has it, else pairs of
// narrower registers. Built and loaded by decoders/kernels/__init__.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 loadu(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void storeu(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// e^x for x <= 0 (Cephes' expf polynomial, ~1 ulp); exactly 0 below -87 (masked entries are -inf)
static inline v16 vexp(v16 x) {
  const v16 lo = splat(-87.0f);
  i16v dead = x < lo;
  x = dead ? lo : x;
  v16 fx = x * splat(1.44269504088896341f);
  v16 n = __builtin_convertvector(__builtin_convertvector(fx - splat(0.5f), i16v), v16);  // fx <= 0: round
  v16 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  v16 p = splat(1.9875691500E-4f);
  p = p * r + splat(1.3981999507E-3f);
  p = p * r + splat(8.3334519073E-3f);
  p = p * r + splat(4.1665795894E-2f);
  p = p * r + splat(1.6666665459E-1f);
  p = p * r + splat(5.0000001201E-1f);
  v16 y = p * r * r + r + splat(1.0f);
  i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
  v16 s;
  std::memcpy(&s, &e, sizeof s);
  y = y * s;
  return dead ? splat(0.f) : y;
}

static inline float hsum(v16 v) {  // pairwise: halves, then quarters, ...
  float a[16];
  std::memcpy(a, &v, sizeof a);
  for (int w = 8; w >= 1; w /= 2)
    for (int t = 0; t < w; t++) a[t] += a[t + w];
  return a[0];
}

static const int BK = 256;   // keys per block
static const int PF_KEYS = 2 * BK;  // software prefetch distance (entries) for K and V
static const int MAX_ROWS = 128;  // query rows per KV head (GQA group x new tokens)

// scores of R rows against nb keys (a multiple of 16) into S[R][BK]; NV key vectors per step, so that
// R * NV accumulators are in flight
template <int D, int R, int NV>
static inline void block_scores(const float* q, const float* kt, long kt_d, int nb, float* S, int pf = 0) {
  int j = 0;
  for (; j + 16 * NV <= nb; j += 16 * NV) {
    v16 acc[R][NV];
    for (int r = 0; r < R; r++)
      for (int u = 0; u < NV; u++) acc[r][u] = splat(0.f);
    for (int d = 0; d < D; d++) {
      if (pf)  // the keys PF entries ahead (the next blocks), one cache line per vector
        for (int u = 0; u < NV; u++) __builtin_prefetch(kt + d * kt_d + j + 16 * u + pf, 0, 3);
      v16 k[NV];
      for (int u = 0; u < NV; u++) k[u] = loadu(kt + d * kt_d + j + 16 * u);
      for (int r = 0; r < R; r++) {
        v16 qs = splat(q[r * D + d]);
        for (int u = 0; u < NV; u++) acc[r][u] += qs * k[u];
      }
    }
    for (int r = 0; r < R; r++)
      for (int u = 0; u < NV; u++) storeu(S + r * BK + j + 16 * u, acc[r][u]);
  }
  for (; j < nb; j += 16) {
    v16 acc[R];
    for (int r = 0; r < R; r++) acc[r] = splat(0.f);
    for (int d = 0; d < D; d++) {
      v16 k = loadu(kt + d * kt_d + j);
      for (int r = 0; r < R; r++) acc[r] += splat(q[r * D + d]) * k;
    }
    for (int r = 0; r < R; r++) storeu(S + r * BK + j, acc[r]);
  }
}

// O[R][D] += P[R][:nb] @ V[:nb], W vectors of 16 output dims at a time (W = 2, or 1 for D = 16); U keys
// in flight, each with its own accumulators (summed at the end)
template <int D, int R, int U>
static inline void block_pv(const float* S, const float* v, long v_row, int nb, float* O, int pf = 0) {
  constexpr int W = D >= 32 ? 2 : 1;
  for (int c = 0; c < D; c += 16 * W) {
    v16 o[U][R][W];
    for (int u = 0; u < U; u++)
      for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) o[u][r][w] = splat(0.f);
    int j = 0;
    for (; j + U <= nb; j += U) {
      for (int u = 0; u < U; u++) {
        const float* vr = v + (long)(j + u) * v_row + c;
        if (pf)
          for (int w = 0; w < W; w++) __builtin_prefetch(vr + (long)pf * v_row + 16 * w, 0, 3);
        v16 x[W];
        for (int w = 0; w < W; w++) x[w] = loadu(vr + 16 * w);
        for (int r = 0; r < R; r++) {
          v16 p = splat(S[r * BK + j + u]);
          for (int w = 0; w < W; w++) o[u][r][w] += p * x[w];
        }
      }
    }
    for (; j < nb; j++) {
      const float* vr = v + (long)j * v_row + c;
      v16 x[W];
      for (int w = 0; w < W; w++) x[w] = loadu(vr + 16 * w);
      for (int r = 0; r < R; r++) {
        v16 p = splat(S[r * BK + j]);
        for (int w = 0; w < W; w++) o[0][r][w] += p * x[w];
      }
    }
    for (int r = 0; r < R; r++)
      for (int w = 0; w < W; w++) {
        v16 a = o[0][r][w];
        for (int u = 1; u < U; u++) a += o[u][r][w];
        storeu(O + r * D + c + 16 * w, loadu(O + r * D + c + 16 * w) + a);
      }
  }
}

// Scores of the G rows q[G][D] (scaled; row r is new token r % nq) against keys j0 .. j0 + nb - 1 (nb =
// min(BK, kv - j0), returned) into S (row r at S + r * BK), tiled by 8 / 4 / 2 / 1 rows; entries a row may
// not see (causal) and the padding up to a multiple of 16 are -inf. `pf`: prefetch distance for the first
// tile (0: none); `tail` [D * 16] scratch for the last partial vector of keys.
template <int D>
static int block_rows(const float* q, const float* kt, long kt_d, int G, int nq, int kv, int j0, float* S,
                      float* tail, int pf) {
  const int nb = std::min(BK, kv - j0);
  const int nfull = nb & ~15, nbv = (nb + 15) & ~15;
  const float* kb = kt + j0;
  if (nfull < nb) {  // the last partial vector of keys: a zero-padded copy (never read past the cache)
    std::memset(tail, 0, sizeof(float) * D * 16);
    for (int d = 0; d < D; d++)
      for (int j = nfull; j < nb; j++) tail[d * 16 + j - nfull] = kb[d * kt_d + j];
  }
  for (int r0 = 0; r0 < G;) {
    const int R = G - r0 >= 8 ? 8 : G - r0 >= 4 ? 4 : G - r0 >= 2 ? 2 : 1;
    const float* qr = q + r0 * D;
    float* sr = S + r0 * BK;
#define VIDSPEC_SCORES(RR, NN)                                            \
  block_scores<D, RR, NN>(qr, kb, kt_d, nfull, sr, r0 == 0 ? pf : 0); \
  if (nfull < nb) block_scores<D, RR, NN>(qr, tail, 16, 16, sr + nfull);
    switch (R) {
      case 8: VIDSPEC_SCORES(8, 2) break;
      case 4: VIDSPEC_SCORES(4, 4) break;
      case 2: VIDSPEC_SCORES(2, 8) break;
      default: VIDSPEC_SCORES(1, 8) break;
    }
#undef VIDSPEC_SCORES
    r0 += R;
  }
  for (int r = 0; r < G; r++) {
    const int lim = std::max(0, std::min(nb, kv - nq + (r % nq) + 1 - j0));  // causal: keys row r sees
    for (int j = lim; j < nbv; j++) S[r * BK + j] = -INFINITY;
  }
  return nb;
}

static inline float row_max(const float* s, int nbv) {  // nbv a multiple of 16
  v16 mx = splat(-INFINITY);
  for (int j = 0; j < nbv; j += 16) {
    const v16 x = loadu(s + j);
    mx = x > mx ? x : mx;
  }
  float bm = -INFINITY;
  for (int t = 0; t < 16; t++) bm = std::max(bm, mx[t]);
  return bm;
}

// one KV head: G rows q[G][D] (already scaled) -> out[G][D]
template <int D>
static void head_attention(const float* q, const float* kt, long kt_d, const float* v, long v_row, float* out,
                           int G, int nq, int kv) {
  alignas(64) float S[MAX_ROWS * BK];
  alignas(64) float O[MAX_ROWS * D];
  alignas(64) float tail[D * 16];
  float m[MAX_ROWS], l[MAX_ROWS];
  for (int r = 0; r < G; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::memset(O, 0, sizeof(float) * G * D);
  for (int j0 = 0; j0 < kv; j0 += BK) {
    const int nb = block_rows<D>(q, kt, kt_d, G, nq, kv, j0, S, tail, j0 + BK + PF_KEYS < kv ? PF_KEYS : 0);
    const int nbv = (nb + 15) & ~15;
    for (int r = 0; r < G; r++) {  // online softmax of the block, row by row
      float* s = S + r * BK;
      const float mn = std::max(m[r], row_max(s, nbv));
      if (mn == -INFINITY) {  // nothing visible yet (cannot happen for a causal row; kept safe)
        std::memset(s, 0, sizeof(float) * nbv);
        continue;
      }
      const float alpha = std::exp(m[r] - mn);  // 0 on the first block
      m[r] = mn;
      v16 sum = splat(0.f);
      const v16 mv = splat(mn);
      for (int j = 0; j < nbv; j += 16) {
        v16 p = vexp(loadu(s + j) - mv);
        storeu(s + j, p);
        sum += p;
      }
      float ls = 0.f;
      for (int t = 0; t < 16; t++) ls += sum[t];
      l[r] = l[r] * alpha + ls;
      if (alpha != 1.f)
        for (int d = 0; d < D; d++) O[r * D + d] *= alpha;
    }
    const float* vb = v + (long)j0 * v_row;
    for (int r0 = 0; r0 < G;) {
      const int pfv = r0 == 0 && j0 + BK + PF_KEYS < kv ? PF_KEYS : 0;
      const int R = G - r0 >= 8 ? 8 : G - r0 >= 4 ? 4 : G - r0 >= 2 ? 2 : 1;
      switch (R) {
        case 8: block_pv<D, 8, 1>(S + r0 * BK, vb, v_row, nb, O + r0 * D, pfv); break;
        case 4: block_pv<D, 4, 2>(S + r0 * BK, vb, v_row, nb, O + r0 * D, pfv); break;
        case 2: block_pv<D, 2, 4>(S + r0 * BK, vb, v_row, nb, O + r0 * D, pfv); break;
        default: block_pv<D, 1, 8>(S + r0 * BK, vb, v_row, nb, O + r0 * D, pfv); break;
      }
      r0 += R;
    }
  }
  for (int r = 0; r < G; r++) {
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; d++) out[r * D + d] = O[r * D + d] * inv;
  }
}

// StD's prompt scoring: mass[j - vs] += the attention probability of every row r < G on key j, for the keys
// vs <= j < ve (the visual span), G rows q[G][D] (scaled) of one KV head, causal as in head_attention. Two
// passes over the keys: the rows' softmax max and sum, then exp(s - max) / sum summed over the rows.
template <int D>
static void head_mass(const float* q, const float* kt, long kt_d, int G, int nq, int kv, int vs, int ve,
                      float* mass) {
  alignas(64) float S[MAX_ROWS * BK];
  alignas(64) float tail[D * 16];
  alignas(64) float col[BK];
  float m[MAX_ROWS], l[MAX_ROWS];
  for (int r = 0; r < G; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  for (int pass = 0; pass < 2; pass++) {
    for (int j0 = 0; j0 < kv; j0 += BK) {
      const int nb = std::min(BK, kv - j0);
      if (pass == 1 && (j0 + nb <= vs || j0 >= ve)) continue;  // no visual key in this block
      block_rows<D>(q, kt, kt_d, G, nq, kv, j0, S, tail, 0);
      const int nbv = (nb + 15) & ~15;
      if (pass == 1) std::memset(col, 0, sizeof(float) * nbv);
      for (int r = 0; r < G; r++) {
        const float* sr = S + r * BK;
        if (pass == 0) {  // running max and sum of the row
          const float mn = std::max(m[r], row_max(sr, nbv));
          if (mn == -INFINITY) continue;
          v16 sum = splat(0.f);
          const v16 mv = splat(mn);
          for (int j = 0; j < nbv; j += 16) sum += vexp(loadu(sr + j) - mv);
          l[r] = l[r] * std::exp(m[r] - mn) + hsum(sum);
          m[r] = mn;
        } else {  // this row's probabilities, summed into the block's column totals
          const v16 mv = splat(m[r]), inv = splat(1.f / l[r]);
          for (int j = 0; j < nbv; j += 16) storeu(col + j, loadu(col + j) + vexp(loadu(sr + j) - mv) * inv);
        }
      }
      if (pass == 1)
        for (int j = std::max(vs, j0); j < std::min(ve, j0 + nb); j++) mass[j - vs] += col[j - j0];
    }
  }
}

extern "C" int vidspec_attn_max_rows() { return MAX_ROWS; }

extern "C" int vidspec_attn_supports(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }

// q [hkv][G][D] (scaled; G = group * nq, row r is new token r % nq), out [hkv][G][D].
// Key d of entry j of head h at kt[h * kt_h + d * kt_d + j]; its value at v[h * v_h + j * v_row + d].
// Row r sees entries j < kv - nq + (r % nq) + 1. Returns 0, or -1 for an unsupported shape.
extern "C" int vidspec_attn(const float* q, const float* kt, const float* v, float* out, int hkv, int G, int nq,
                            int D, int kv, long kt_h, long kt_d, long v_h, long v_row, int threads) {
  if (G > MAX_ROWS || G < 1 || nq < 1 || kv < nq || !vidspec_attn_supports(D)) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && hkv > 1)
  for (int h = 0; h < hkv; h++) {
    const float* qh = q + (long)h * G * D;
    float* oh = out + (long)h * G * D;
    if (D == 16) head_attention<16>(qh, kt + h * kt_h, kt_d, v + h * v_h, v_row, oh, G, nq, kv);
    else if (D == 32) head_attention<32>(qh, kt + h * kt_h, kt_d, v + h * v_h, v_row, oh, G, nq, kv);
    else if (D == 64) head_attention<64>(qh, kt + h * kt_h, kt_d, v + h * v_h, v_row, oh, G, nq, kv);
    else head_attention<128>(qh, kt + h * kt_h, kt_d, v + h * v_h, v_row, oh, G, nq, kv);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------
// Decode steps of a Qwen2-style decoder stack for n new tokens in one call (StD's draft steps, and the
// native forward of every vanilla step and verify pass; see decoders/kernels/__init__.py, `NativeStep`):
// RMSNorm -> fused QKV (+bias) -> 1-D RoPE -> K/V written into the cache at index `len` + t -> attention over
// len + t + 1 entries -> o_proj + residual -> RMSNorm -> SwiGLU + residual, then the final RMSNorm. The
// projections' weights panel-packed (gemm below), the rest as decoders.fastpath keeps them on CPU.

// y[N] = x[K] @ W[K][N] (+ add[N] when add != nullptr), 4 output vectors at a time
static void gemv(const float* x, const float* W, int K, int N, const float* add, float* y) {
  int n = 0;
  for (; n + 64 <= N; n += 64) {
    v16 a0 = splat(0.f), a1 = splat(0.f), a2 = splat(0.f), a3 = splat(0.f);
    for (int k = 0; k < K; k++) {
      const float* w = W + (long)k * N + n;
      v16 xs = splat(x[k]);
      a0 += xs * loadu(w);
      a1 += xs * loadu(w + 16);
      a2 += xs * loadu(w + 32);
      a3 += xs * loadu(w + 48);
    }
    if (add) {
      a0 += loadu(add + n);
      a1 += loadu(add + n + 16);
      a2 += loadu(add + n + 32);
      a3 += loadu(add + n + 48);
    }
    storeu(y + n, a0);
    storeu(y + n + 16, a1);
    storeu(y + n + 32, a2);
    storeu(y + n + 48, a3);
  }
  for (; n + 16 <= N; n += 16) {
    v16 a = splat(0.f);
    for (int k = 0; k < K; k++) a += splat(x[k]) * loadu(W + (long)k * N + n);
    if (add) a += loadu(add + n);
    storeu(y + n, a);
  }
  for (; n < N; n++) {
    float a = 0.f;
    for (int k = 0; k < K; k++) a += x[k] * W[(long)k * N + n];
    y[n] = add ? a + add[n] : a;
  }
}

// vidspec_stepn's projections read their weights panel-packed: a [K][N] matrix (N a multiple of 16) as N / 16
// panels of [K][16] (panel p holds columns 16 p .. 16 p + 15), so every panel is one contiguous stream over k
// (the [K][N] layout read a 64-byte piece every N floats: with N = 1024 a 4 KiB stride, which kept the loads
// waiting on the caches). Y[r] = X[r] @ W (+ add) for n rows: rows of X at stride xs, of Y at stride ys; `add`
// is a bias [N] (add_rs == 0), rows at stride add_rs (may be Y itself: the residual, read before it is
// written) or null. Every output is summed over k in order, then the add: the operations gemv performs, so a
// row's result does not depend on how many rows are computed together (tiles of up to 6 rows; `gemm` below
// orders the loops so that the weights are streamed once per pass).
template <int R, int NV>
static inline void gemm_panels(const float* X, long xs, const float* P, int K, int p0, const float* add,
                               long add_rs, float* Y, long ys) {
  v16 acc[R][NV];
  const float* w[NV];
  for (int u = 0; u < NV; u++) w[u] = P + (long)(p0 + u) * K * 16;
  for (int r = 0; r < R; r++)
    for (int u = 0; u < NV; u++) acc[r][u] = splat(0.f);
  for (int k = 0; k < K; k++) {
    v16 wk[NV];
    for (int u = 0; u < NV; u++) wk[u] = loadu(w[u] + 16 * k);
    for (int r = 0; r < R; r++) {
      const v16 xk = splat(X[r * xs + k]);
      for (int u = 0; u < NV; u++) acc[r][u] += xk * wk[u];
    }
  }
  for (int r = 0; r < R; r++)
    for (int u = 0; u < NV; u++) {
      v16 a = acc[r][u];
      if (add) a += loadu(add + r * add_rs + 16 * (p0 + u));
      storeu(Y + r * ys + 16 * (p0 + u), a);
    }
}

// one group of NV panels (or one panel, NV = 1) for every tile of rows: 6 / 4 / 2 / 1 rows at a time
template <int NV>
static inline void gemm_group(const float* X, long xs, int n, const float* P, int K, int p, const float* add,
                              long add_rs, float* Y, long ys) {
  for (int r0 = 0; r0 < n;) {
    const int R = n - r0 >= 6 ? 6 : n - r0 >= 4 ? 4 : n - r0 >= 2 ? 2 : 1;
    const float* xr = X + r0 * xs;
    const float* ar = add ? add + r0 * add_rs : nullptr;
    float* yr = Y + r0 * ys;
    switch (R) {
      case 6: gemm_panels<6, NV>(xr, xs, P, K, p, ar, add_rs, yr, ys); break;
      case 4: gemm_panels<4, NV>(xr, xs, P, K, p, ar, add_rs, yr, ys); break;
      case 2: gemm_panels<2, NV>(xr, xs, P, K, p, ar, add_rs, yr, ys); break;
      default: gemm_panels<1, NV>(xr, xs, P, K, p, ar, add_rs, yr, ys); break;
    }
    r0 += R;
  }
}

// The panel groups outermost: a group (4 panels, K * 256 bytes: 32 KiB at K = 128, 128 KiB at K = 512) is
// read from memory once and stays in cache for every tile of rows, so a pass of n rows streams the weights
// once, not once per tile (the tile loop outermost, until session 23, streamed them ceil(n / 6) times).
// With nth > 1 (vidspec_stepn's parallel region) the caller is thread tid of nth and computes its share of the
// groups (contiguous ranges; the caller places the barriers); a column's sums do not depend on which thread
// computes them.
static void gemm(const float* X, long xs, int n, const float* P, int K, int N, const float* add, long add_rs,
                 float* Y, long ys, int tid = 0, int nth = 1) {
  const int np = N / 16, groups = np / 4, units = groups + np % 4;
  const int u0 = (int)((long)units * tid / nth), u1 = (int)((long)units * (tid + 1) / nth);
  for (int u = u0; u < u1; u++) {
    if (u < groups) gemm_group<4>(X, xs, n, P, K, 4 * u, add, add_rs, Y, ys);
    else gemm_group<1>(X, xs, n, P, K, 4 * groups + (u - groups), add, add_rs, Y, ys);
  }
}

// g[i] = silu(g[i]) * g[I + i] for i < I (SwiGLU), 16 lanes at a time: silu(a) = a * sigmoid(a) with
// z = e^-|a| (vexp's domain), sigmoid(a) = 1 / (1 + z) for a >= 0 and z / (1 + z) below
static inline void silu_mul(float* g, int I) {
  int i = 0;
  for (; i + 16 <= I; i += 16) {
    const v16 a = loadu(g + i);
    const v16 na = a < splat(0.f) ? a : -a;  // -|a|
    const v16 z = vexp(na);
    const v16 num = a < splat(0.f) ? a * z : a;
    storeu(g + i, num / (splat(1.f) + z) * loadu(g + I + i));
  }
  for (; i < I; i++) {
    const float a = g[i];
    g[i] = a / (1.0f + std::exp(-a)) * g[I + i];
  }
}

// RoPE on the q and k heads of one row's qkv (cs, sn: that row's cos and signed sin)
static inline void rope_row(float* qkv, int heads, int D, const float* cs, const float* sn) {
  for (int h = 0; h < heads; h++) {
    float* p = qkv + h * D;
    float tmp[128];
    for (int i = 0; i < D; i++) tmp[i] = p[i] * cs[i] + p[(i + D / 2) % D] * sn[i];
    std::memcpy(p, tmp, sizeof(float) * D);
  }
}

static void rms_norm(const float* x, const float* w, float eps, int H, float* y) {
  double ss = 0.0;
  for (int i = 0; i < H; i++) ss += (double)x[i] * x[i];
  const float r = 1.0f / std::sqrt((float)(ss / H) + eps);
  for (int i = 0; i < H; i++) y[i] = w[i] * (x[i] * r);
}

// weights per layer, in this order: input norm, Wqkv [H][(nq+2nkv)D], bqkv, Wo [nq D][H], post norm,
// Wgu [H][2I], Wdown [I][H], the four matrices panel-packed (gemm above; H, (nq+2nkv)D and I multiples of
// 16); floats per layer: eps1, eps2, attention scale.
// n new tokens (x_in [n][H], their embeddings) at text positions pos, pos + 1, ...: K/V written at cache
// indices len.., each row attending to the cache and, causally, to the rows before it; out [n][H]. The
// projections run on all n rows at once (gemm: the weights streamed once per pass, each row's sums in
// gemv's order); the attention kernel tiles the rows by 8 / 4 / 2 / 1, so a row's rounding there may depend
// on n. With `mass` (per layer [nkv][ve - vs], accumulated into): the n rows' attention probabilities on the
// cache entries vs..ve-1, summed over each KV head's query rows (head_mass; StD's prompt scoring).
extern "C" int vidspec_stepn(const float* x_in, int n, const float* const* w, const float* f, float* const* kt,
                             float* const* v, const long* cap, int len, int L, int H, int nq, int nkv, int D,
                             int I, const float* inv_freq, float pos, const float* norm_w, float norm_eps,
                             float* out, float* scratch, int threads, float* const* mass, int vs, int ve) {
  if (!vidspec_attn_supports(D) || nq % nkv != 0 || n < 1 || (nq / nkv) * n > MAX_ROWS) return -1;
  if (mass && !(0 <= vs && vs < ve && ve <= len)) return -1;
  const int g = nq / nkv, nqkv = (nq + 2 * nkv) * D;
  float* x = scratch;                  // [n][H] residual streams
  float* y = x + (long)n * H;          // [n][H] normed
  float* qkv = y + (long)n * H;        // [n][nqkv]
  float* qa = qkv + (long)n * nqkv;    // [nkv][g n][D] scaled queries, the kernel's row order
  float* oa = qa + (long)n * nq * D;   // [nkv][g n][D] attention outputs
  float* att = oa + (long)n * nq * D;  // [n][nq D] attention outputs by row and q head
  float* gu = att + (long)n * nq * D;  // [n][2I]
  float* cs = gu + 2L * n * I;         // [n][D] cos
  float* sn = cs + (long)n * D;        // [n][D] signed sin: rotate_half(x) * sin == roll(x, D/2) * sn
  std::memcpy(x, x_in, sizeof(float) * n * H);
  for (int t = 0; t < n; t++)
    for (int i = 0; i < D / 2; i++) {
      const float fr = (pos + t) * inv_freq[i];
      cs[t * D + i] = cs[t * D + i + D / 2] = std::cos(fr);
      sn[t * D + i] = -std::sin(fr);
      sn[t * D + i + D / 2] = std::sin(fr);
    }
  // With threads > 1, one parallel region for the whole stack: each thread takes its share of the projections'
  // column groups (gemm), of the KV heads in the attention and of the rows in the per-row steps, and barriers
  // order the phases; with one thread the same code runs serially, with no OpenMP call at all.
  auto stack = [&](const int tid, const int nth) {
    auto sync = [nth]() {
      if (nth > 1) {
#pragma omp barrier
      }
    };
    const int t0 = (int)((long)n * tid / nth), t1 = (int)((long)n * (tid + 1) / nth);  // this thread's rows
    for (int l = 0; l < L; l++) {
      const float* const* lw = w + 7 * l;
      const float eps1 = f[3 * l], eps2 = f[3 * l + 1], scale = f[3 * l + 2];
      const long c = cap[l];
      for (int t = t0; t < t1; t++) rms_norm(x + (long)t * H, lw[0], eps1, H, y + (long)t * H);
      sync();
      gemm(y, H, n, lw[1], H, nqkv, lw[2], 0, qkv, nqkv, tid, nth);
      sync();
      for (int t = t0; t < t1; t++) {
        float* qt = qkv + (long)t * nqkv;
        rope_row(qt, nq + nkv, D, cs + (long)t * D, sn + (long)t * D);
        const float* k = qt + nq * D;
        const float* vv = k + nkv * D;
        for (int h = 0; h < nkv; h++)
          for (int d = 0; d < D; d++) {
            kt[l][(long)h * D * c + (long)d * c + len + t] = k[h * D + d];
            v[l][(long)h * c * D + (long)(len + t) * D + d] = vv[h * D + d];
          }
        for (int hq = 0; hq < nq; hq++)  // q head hq = h g + gi -> row gi n + t of kv head h
          for (int d = 0; d < D; d++)
            qa[((long)(hq / g) * g * n + (long)(hq % g) * n + t) * D + d] = qt[hq * D + d] * scale;
      }
      sync();
      for (int h = tid; h < nkv; h += nth) {
        const float* qh = qa + (long)h * g * n * D;
        float* oh = oa + (long)h * g * n * D;
        const float* kh = kt[l] + (long)h * D * c;
        const float* vh = v[l] + (long)h * c * D;
        if (D == 16) head_attention<16>(qh, kh, c, vh, D, oh, g * n, n, len + n);
        else if (D == 32) head_attention<32>(qh, kh, c, vh, D, oh, g * n, n, len + n);
        else if (D == 64) head_attention<64>(qh, kh, c, vh, D, oh, g * n, n, len + n);
        else head_attention<128>(qh, kh, c, vh, D, oh, g * n, n, len + n);
        if (mass) {  // the rows' attention mass on the visual span, per KV head (StD's prompt scoring)
          float* mh = mass[l] + (long)h * (ve - vs);
          if (D == 16) head_mass<16>(qh, kh, c, g * n, n, len + n, vs, ve, mh);
          else if (D == 32) head_mass<32>(qh, kh, c, g * n, n, len + n, vs, ve, mh);
          else if (D == 64) head_mass<64>(qh, kh, c, g * n, n, len + n, vs, ve, mh);
          else head_mass<128>(qh, kh, c, g * n, n, len + n, vs, ve, mh);
        }
      }
      sync();
      for (int t = t0; t < t1; t++)
        for (int hq = 0; hq < nq; hq++)
          std::memcpy(att + ((long)t * nq + hq) * D,
                      oa + ((long)(hq / g) * g * n + (long)(hq % g) * n + t) * D, sizeof(float) * D);
      sync();
      gemm(att, (long)nq * D, n, lw[3], nq * D, H, x, H, x, H, tid, nth);  // o_proj + residual (x read first)
      sync();
      for (int t = t0; t < t1; t++) rms_norm(x + (long)t * H, lw[4], eps2, H, y + (long)t * H);
      sync();
      gemm(y, H, n, lw[5], H, 2 * I, nullptr, 0, gu, 2L * I, tid, nth);
      sync();
      for (int t = t0; t < t1; t++) silu_mul(gu + 2L * t * I, I);
      sync();
      gemm(gu, 2L * I, n, lw[6], I, H, x, H, x, H, tid, nth);  // down + residual
      sync();
    }
  };
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    stack(omp_get_thread_num(), omp_get_num_threads());
  } else {
    stack(0, 1);
  }
  for (int t = 0; t < n; t++) rms_norm(x + (long)t * H, norm_w, norm_eps, H, out + (long)t * H);
  return 0;
}

extern "C" long vidspec_stepn_scratch(int H, int nq, int nkv, int D, int I, int n) {
  return 2L * n * H + (long)n * (nq + 2 * nkv) * D + 3L * n * nq * D + 2L * n * I + 2L * n * D;
}

// One token (StD's draft steps): vidspec_stepn with n = 1.
extern "C" int vidspec_step1(const float* x_in, const float* const* w, const float* f, float* const* kt,
                             float* const* v, const long* cap, int len, int L, int H, int nq, int nkv, int D,
                             int I, const float* inv_freq, float pos, const float* norm_w, float norm_eps,
                             float* out, float* scratch) {
  return vidspec_stepn(x_in, 1, w, f, kt, v, cap, len, L, H, nq, nkv, D, I, inv_freq, pos, norm_w, norm_eps, out,
                       scratch, 1, nullptr, 0, 0);
}

extern "C" long vidspec_step1_scratch(int H, int nq, int nkv, int D, int I) {
  return vidspec_stepn_scratch(H, nq, nkv, D, I, 1);
}

// ---------------------------------------------------------------------------------------------------------
// A greedy Sparrow draft chain in one call (decoders/proposers/sparrow.py, `SparrowHead.step_rows` is the
// torch twin; decoders/kernels/__init__.py, `NativeSparrow`). The head is one decoder layer over its own
// text-only KV cache ([nkv][cap][D], the standard layout) with the norms computed as x / ||x|| and their
// weights folded into the projections that follow. Row i's input is tok_rows[id_i] + feat_i @ Wfc_h; its K/V
// go to index len + i. The head is one layer, so a row's K/V depend on its input alone and only the last
// given row's output feature is ever used: the first m - 1 rows are encoded up to their K/V only (fc, norm,
// QKV, RoPE; up to ENC_ROWS rows per gemm, each row summed as a one-row product would be, so their K/V are
// what a full pass writes). The last given row and every draft row then run the whole layer, attending to
// entries 0..len + i. The last given row's feature gives the logits (feature @ Whead + bhead) and their argmax
// is the first draft; every further draft row is (that token, that feature). Drafting stops after g tokens or
// at the first token in `stop`; the last draft is not encoded. Returns the number of drafts written to
// out_tokens, or -1 for an unsupported shape.
// Weights, in this order: Wfc_h [H][H], Wqkv [H][(nq+2nkv)D], bqkv, Wo [nq D][H], Wgu [H][2I], Wdown [I][H]
// (these five panel-packed, as vidspec_stepn's: gemm above), out-norm weight [H], Whead [H][V], bhead [V] or
// null.


static void unit(const float* x, int H, float* y) {
  double ss = 0.0;
  for (int i = 0; i < H; i++) ss += (double)x[i] * x[i];
  const float r = 1.0f / std::max((float)std::sqrt(ss), 1e-12f);
  for (int i = 0; i < H; i++) y[i] = x[i] * r;
}

static const int ENC_ROWS = 8;  // committed rows encoded per gemm (their K/V only)

// one row's K and V (from its roped qkv) into the head's cache ([nkv][cap][D]) at index pos
static inline void put_kv(const float* qkv, int nq, int nkv, int D, long cap, int pos, float* keys,
                          float* values) {
  for (int h = 0; h < nkv; h++) {
    std::memcpy(keys + ((long)h * cap + pos) * D, qkv + (nq + h) * D, sizeof(float) * D);
    std::memcpy(values + ((long)h * cap + pos) * D, qkv + (nq + nkv + h) * D, sizeof(float) * D);
  }
}

extern "C" long vidspec_sparrow_scratch(int H, int nq, int nkv, int D, int I, int V, long cap) {
  const long nqkv = (long)(nq + 2 * nkv) * D;
  return 4L * H + nqkv + (long)nq * D + 2L * I + cap + V + ENC_ROWS * (2L * H + nqkv);
}

extern "C" int vidspec_sparrow_chain(const float* tok_rows, const int* ids, const float* feats, int m,
                                     const float* const* w, float* keys, float* values, long cap, int len,
                                     const float* cos, const float* sin_signed, int H, int nq, int nkv, int D,
                                     int I, int V, int g, const int* stop, int nstop, int* out_tokens,
                                     float* scratch) {
  if (m < 1 || g < 1 || D > 128 || nq % nkv != 0 || len + m + g - 1 > cap) return -1;
  const int grp = nq / nkv, nqkv = (nq + 2 * nkv) * D;
  const float scale = 1.0f / std::sqrt((float)D);
  float* x = scratch;           // [H] residual stream
  float* y = x + H;             // [H] unit-normed
  float* f = y + H;             // [H] the row's output feature
  float* hin = f + H;           // [H] the row's input feature (a copy: f is overwritten)
  float* qkv = hin + H;         // [nqkv]
  float* att = qkv + nqkv;      // [nq D]
  float* gu = att + nq * D;     // [2I]
  float* sc = gu + 2 * I;       // [cap] scores
  float* logits = sc + cap;     // [V]
  float* ex = logits + V;       // [ENC_ROWS][H] committed rows: fc output
  float* ey = ex + ENC_ROWS * H;  // [ENC_ROWS][H] ... unit-normed
  float* eqkv = ey + ENC_ROWS * H;  // [ENC_ROWS][nqkv]
  for (int r0 = 0; r0 < m - 1; r0 += ENC_ROWS) {  // the committed rows before the last: K/V only
    const int nr = std::min(ENC_ROWS, m - 1 - r0);
    for (int t = 0; t < nr; t++)
      std::memcpy(ex + (long)t * H, tok_rows + (long)ids[r0 + t] * H, sizeof(float) * H);
    gemm(feats + (long)r0 * H, H, nr, w[0], H, H, ex, H, ex, H);  // + the token's row (read before written)
    for (int t = 0; t < nr; t++) unit(ex + (long)t * H, H, ey + (long)t * H);
    gemm(ey, H, nr, w[1], H, nqkv, w[2], 0, eqkv, nqkv);
    for (int t = 0; t < nr; t++) {
      const int row = r0 + t, pos = len + row;
      float* rq = eqkv + (long)t * nqkv;
      rope_row(rq, nq + nkv, D, cos + (long)row * D, sin_signed + (long)row * D);
      put_kv(rq, nq, nkv, D, cap, pos, keys, values);
    }
  }
  int drafted = 0, tok = ids[0];
  for (int row = m - 1;; row++) {
    const int pos = len + row;
    if (row < m) {
      tok = ids[row];
      std::memcpy(hin, feats + (long)row * H, sizeof(float) * H);
    } else {
      std::memcpy(hin, f, sizeof(float) * H);  // a draft row: the last draft and the feature behind it
    }
    gemm(hin, H, 1, w[0], H, H, tok_rows + (long)tok * H, 0, x, H);
    unit(x, H, y);
    gemm(y, H, 1, w[1], H, nqkv, w[2], 0, qkv, nqkv);
    rope_row(qkv, nq + nkv, D, cos + (long)row * D, sin_signed + (long)row * D);
    put_kv(qkv, nq, nkv, D, cap, pos, keys, values);
    const int n = pos + 1;
    for (int hq = 0; hq < nq; hq++) {  // attention over the head's own entries 0..pos
      const float* q = qkv + hq * D;
      const float* kh = keys + (long)(hq / grp) * cap * D;
      const float* vh = values + (long)(hq / grp) * cap * D;
      float* o = att + hq * D;
      float mx = -INFINITY;
      if (D % 16 == 0) {  // 16 dims per vector (D <= 128: at most 8 vectors)
        for (int j = 0; j < n; j++) {
          const float* kj = kh + (long)j * D;
          v16 acc = splat(0.f);
          for (int d = 0; d < D; d += 16) acc += loadu(q + d) * loadu(kj + d);
          sc[j] = hsum(acc) * scale;
          mx = std::max(mx, sc[j]);
        }
      } else {
        for (int j = 0; j < n; j++) {
          float s = 0.f;
          for (int d = 0; d < D; d++) s += q[d] * kh[(long)j * D + d];
          sc[j] = s * scale;
          mx = std::max(mx, sc[j]);
        }
      }
      float sum = 0.f;
      for (int j = 0; j < n; j++) sum += (sc[j] = std::exp(sc[j] - mx));
      if (D % 16 == 0) {
        v16 acc[8];
        for (int u = 0; u < D / 16; u++) acc[u] = splat(0.f);
        for (int j = 0; j < n; j++) {
          const v16 p = splat(sc[j] / sum);
          for (int u = 0; u < D / 16; u++) acc[u] += p * loadu(vh + (long)j * D + 16 * u);
        }
        for (int u = 0; u < D / 16; u++) storeu(o + 16 * u, acc[u]);
      } else {
        for (int d = 0; d < D; d++) o[d] = 0.f;
        for (int j = 0; j < n; j++) {
          const float p = sc[j] / sum;
          for (int d = 0; d < D; d++) o[d] += p * vh[(long)j * D + d];
        }
      }
    }
    gemm(att, nq * D, 1, w[3], nq * D, H, x, 0, x, H);  // o_proj + residual
    unit(x, H, y);
    gemm(y, H, 1, w[4], H, 2 * I, nullptr, 0, gu, 2 * I);
    for (int i = 0; i < I; i++) {
      const float a = gu[i];
      gu[i] = a / (1.0f + std::exp(-a)) * gu[I + i];
    }
    gemm(gu, I, 1, w[5], I, H, x, 0, x, H);
    unit(x, H, y);
    for (int i = 0; i < H; i++) f[i] = y[i] * w[6][i];
    gemv(f, w[7], H, V, w[8], logits);
    int best = 0;
    for (int i = 1; i < V; i++)
      if (logits[i] > logits[best]) best = i;
    tok = out_tokens[drafted++] = best;
    bool stopped = false;
    for (int i = 0; i < nstop; i++) stopped |= stop[i] == best;
    if (stopped || drafted == g) return drafted;
  }
}
