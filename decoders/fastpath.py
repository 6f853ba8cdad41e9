"""A lean forward of the decoder stack for steps of a few text tokens (decode, verify, draft).

Contract:
- `FastDecoder(lm)` reads the weights of a loaded Qwen2-style text stack (Qwen2-VL, Qwen2.5-VL, and the
  Qwen2 LM of LLaVA-OneVision) and computes the same function as transformers' forward for text tokens:
  RMSNorm -> fused QKV -> RoPE -> write K/V into our `KVCache` -> attention -> o_proj -> RMSNorm -> SwiGLU.
  For text tokens the three mRoPE axes carry the same position, so mRoPE reduces to 1-D RoPE with the same
  inverse frequencies; this path is only used for text tokens after the video.
- Why: a decode step of a small model is dominated by per-op overhead (HF's mask building, per-projection
  GEMMs, mRoPE recomposition, output dataclasses). Fusing Q/K/V and gate/up halves the op count. Every one
  of our decode paths (vanilla steps, verification, StD drafts) goes through it, so comparisons between
  methods stay fair, and greedy outputs stay token-identical to the oracle (tested).
- On CPU the projection weights are kept transposed ([in, out], contiguous) and the rows are multiplied as
  2-D `addmm`/`mm` (bias or residual fused): MKL's small-M GEMMs are faster on that layout, and the 2-D
  form skips the batch folding of a 3-D `F.linear`. Measured on the reference model, interleaved call by
  call (`benchmarks/lean_layout.py`): 1.13-1.21x per step of 1-8 rows at 512 visual tokens. It costs a
  transposed copy of the decoder's projection weights, so on other devices the weights are only viewed
  transposed (no copy). `logits(h)` is the target's `lm_head` on the same layout.
- `native_forward` (on by default; `VIDSPEC_NATIVE_FORWARD=0` or `vidspec bench --torch-forward` switch it
  off): on CPU in float32, every forward of up to `NativeStep.max_rows` tokens (vanilla steps, verify
  passes) is one native call of the whole stack (`decoders.kernels.NativeStep`, `vidspec_stepn`) instead of
  ~100 torch ops, StD's prompt scoring included (`recorded_forward`); the torch ops remain for everything
  else (other devices and dtypes, longer prefills, a forward whose attention is being watched). It
  computes the same function to float rounding (tested on every family), and vanilla and every drafter's
  verify go through it alike, so comparisons stay fair.
  Measured on the reference model (README, "The native forward"): our vanilla ~4-5x faster at 0.5k-1.5k
  visual tokens and ~1.2x at 25.6k on this CPU.
- `FastDecoder.supported(lm)` is False for anything it does not reproduce exactly (sliding windows,
  non-default RoPE scaling, other activations); callers then use the transformers forward.
- `FastDecoder.compiled()` is the same forward through `torch.compile` (inductor, dynamic shapes: the cache
  length grows every step without recompiling), built once per decoder. It is for drafts only (StD's
  `compile_draft`): a draft's rounding never reaches the output, which the eager verify pass decides, so
  losslessness does not depend on the compiler. The first call compiles (~45 s on this CPU; the inductor cache
  under `TORCHINDUCTOR_CACHE_DIR` shortens later processes).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from decoders import kernels
from decoders.attention import active_watch, small_q_attention
from decoders.cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as Qwen2RMSNorm (in float32, back to the input dtype, then the weight); F.rms_norm computes the same
    # x * rsqrt(mean(x^2) + eps) in one op (bitwise equal on CPU, checked in tests/test_decoding.py)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def transposed(w: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A weight [out, in] as [in, out] for `addmm`/`mm`: a contiguous copy, or (copy=False) a view."""
    return w.detach().t().contiguous() if copy else w.detach().t()


def rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bitwise: rotate_half(x) * sin == roll(x) * [-sin | sin]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class FastDecoder:
    @staticmethod
    def supported(lm: object) -> bool:
        tm = lm.text_model
        cfg = lm.text_config
        rot = tm.rotary_emb
        rope = getattr(cfg, "rope_parameters", None) or {}
        return (
            rope.get("rope_type", "default") == "default"
            and float(getattr(rot, "attention_scaling", 1.0)) == 1.0
            and not getattr(tm, "has_sliding_layers", False)
            and getattr(cfg, "hidden_act", "silu") == "silu"
            and all(
                hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj") for layer in tm.layers
            )
        )

    def __init__(self, lm: object) -> None:
        tm = lm.text_model
        self.embed = tm.embed_tokens.weight
        self.inv_freq = tm.rotary_emb.inv_freq.float()
        self.norm_w, self.norm_eps = tm.norm.weight, tm.norm.variance_epsilon
        self.nq, self.nkv, self.d = lm.num_heads, lm.num_kv_heads, lm.head_dim
        self._compiled: Callable[[torch.Tensor, int, KVCache], torch.Tensor] | None = None
        self._native: object | None = None
        self._native_tried = False
        # every forward of up to `NativeStep.max_rows` tokens (vanilla steps, verify passes) as one native
        # call where the kernel applies (on by default; VIDSPEC_NATIVE_FORWARD=0 keeps the torch ops)
        self.native_forward = os.environ.get("VIDSPEC_NATIVE_FORWARD", "1") != "0"
        on_cpu = self.embed.device.type == "cpu"

        def t(w: torch.Tensor) -> torch.Tensor:
            return transposed(w, copy=on_cpu)

        self.layers = []
        for layer in tm.layers:
            a, m = layer.self_attn, layer.mlp
            wqkv = t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dim=0))
            bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], dim=0).detach().contiguous()
            wgu = t(torch.cat([m.gate_proj.weight, m.up_proj.weight], dim=0))
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    layer.input_layernorm.variance_epsilon,
                    wqkv,
                    bqkv,
                    t(a.o_proj.weight),
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon,
                    wgu,
                    t(m.down_proj.weight),
                    a.scaling,
                )
            )
        head = lm.lm_head
        self.head_w = t(head.weight)  # [H, V]
        self.head_b = None if head.bias is None else head.bias.detach()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V]: the target's lm_head."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = (
            torch.mm(flat, self.head_w)
            if self.head_b is None
            else torch.addmm(self.head_b, flat, self.head_w)
        )
        return out.view(*hidden.shape[:-1], -1).float()

    def native_step(self) -> object | None:
        """The one-call native step for this stack (`decoders.kernels.NativeStep`), made on first use and
        kept; None where the kernel is unavailable (no compiler, another device or dtype)."""
        if not self._native_tried:
            self._native = kernels.NativeStep.create(self)
            self._native_tried = True
        return self._native

    def compiled(self) -> Callable[[torch.Tensor, int, KVCache], torch.Tensor]:
        """`forward` compiled with inductor (dynamic shapes), created on first use and kept."""
        if self._compiled is None:
            self._compiled = torch.compile(self.forward, dynamic=True)
        return self._compiled

    @torch.inference_mode()
    def recorded_forward(
        self, input_ids: torch.Tensor, start: int, cache: KVCache, record: object
    ) -> torch.Tensor | None:
        """`forward` through the native stack while adding each layer's attention mass on the recorder's
        visual span to `record.scores` (StD's prompt scoring; `decoders.attention.record_visual_attention`);
        None where the native stack does not apply (the caller then records through the transformers
        forward)."""
        return self._native_call(input_ids, start, cache, record)

    def _native_call(
        self, input_ids: torch.Tensor, start: int, cache: KVCache, record: object | None = None
    ) -> torch.Tensor | None:
        """The whole stack in one native call, or None where it does not apply (switched off, a watched
        forward, no kernel, a cache or row count the kernel does not take)."""
        if not self.native_forward or active_watch() is not None:
            return None
        native = self.native_step()
        if native is None:
            return None
        return native.step(input_ids, start, cache, torch.get_num_threads(), record=record)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """input_ids [1, n] at text positions start..start+n-1 -> final normed hidden [1, n, H]."""
        out = self._native_call(input_ids, start, cache)
        if out is not None:
            return out
        n = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)  # [1, n, H]
        pos = torch.arange(start, start + n, device=x.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(x.device)[None, :]  # [n, D/2]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(x.dtype)  # [n, D]
        sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(x.dtype)  # signed for `rope_signed`
        nq, nkv, d = self.nq, self.nkv, self.d
        watch = active_watch()  # StD's refresh: where each new query looks (one cheap sum per layer)
        x = x[0]  # [n, H]: the rows as a 2-D matrix (weights are [in, out], see the module docstring)
        for i, (w1, e1, wqkv, bqkv, wo, w2, e2, wgu, wdown, scale) in enumerate(self.layers):
            y = rms_norm(x, w1, e1)
            qkv = torch.addmm(bqkv, y, wqkv)  # [n, (nq + 2 nkv) d]
            qk, v = qkv.split([(nq + nkv) * d, nkv * d], dim=-1)
            qk = rope_signed(qk.view(1, n, nq + nkv, d).transpose(1, 2), cos, sin)  # q and k heads at once
            q, k = qk[:, :nq], qk[:, nq:]
            v = v.view(1, n, nkv, d).transpose(1, 2)
            keys, values = cache.layers[i].update(k, v)
            # new rows see the whole cache and, causally, each other
            attn = small_q_attention(
                q, keys, values, None, scale, causal_tail=True, watch=None if watch is None else (watch, i)
            )  # [1, n, nq, d]
            x = torch.addmm(x, attn.reshape(n, nq * d), wo)  # residual fused
            y = rms_norm(x, w2, e2)
            gate, up = torch.mm(y, wgu).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, wdown)
        return rms_norm(x, self.norm_w, self.norm_eps)[None]
