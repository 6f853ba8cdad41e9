// A/B of vidspec_stepn's projection product (`gemm` in decoders/kernels/attn.cpp) between two versions of the
// kernel source, in one process, interleaved: benchmarks/gemm_ab.sh compiles this file with A_SRC and B_SRC
// naming the two copies. Prints the median time and GFLOP/s of each for n rows of X [n][K] against a
// panel-packed [K][N], and checks that both give bit-identical outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace a {
#include A_SRC
}
namespace b {
#include B_SRC
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: gemm_ab K N n [repeats]\n");
    return 2;
  }
  const int K = std::atoi(argv[1]), N = std::atoi(argv[2]), n = std::atoi(argv[3]);
  const int reps = argc > 4 ? std::atoi(argv[4]) : 7;
  std::vector<float> P((long)K * N), X((long)n * K), Ya((long)n * N), Yb((long)n * N);
  std::srand(0);
  for (auto& x : P) x = (std::rand() % 2001) / 1000.f - 1.f;
  for (auto& x : X) x = (std::rand() % 2001) / 1000.f - 1.f;
  std::vector<double> ta, tb;
  for (int r = 0; r < reps; r++)
    for (int which = 0; which < 2; which++) {
      const auto t0 = std::chrono::steady_clock::now();
      if (which == 0) a::gemm(X.data(), K, n, P.data(), K, N, nullptr, 0, Ya.data(), N);
      else b::gemm(X.data(), K, n, P.data(), K, N, nullptr, 0, Yb.data(), N);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (which == 0 ? ta : tb).push_back(s);
    }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  const double ma = ta[ta.size() / 2], mb = tb[tb.size() / 2], fl = 2.0 * K * N * n;
  const bool same = std::memcmp(Ya.data(), Yb.data(), sizeof(float) * Ya.size()) == 0;
  std::printf("{\"K\": %d, \"N\": %d, \"rows\": %d, \"a_ms\": %.4f, \"b_ms\": %.4f, \"a_gflops\": %.1f, "
              "\"b_gflops\": %.1f, \"b_over_a\": %.3f, \"identical\": %s}\n",
              K, N, n, ma * 1e3, mb * 1e3, fl / ma / 1e9, fl / mb / 1e9, ma / mb, same ? "true" : "false");
  return same ? 0 : 1;
}
