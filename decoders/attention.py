"""The decoder's attention function: transformers' SDPA, plus optional recording of text->visual attention.

Contract:
- `ATTN_NAME` ("vidspec_sdpa") is registered in both transformers' `AttentionInterface` and
  `AttentionMaskInterface` (registering only the first silently drops causal masks on multi-token steps).
  It computes the same attention as `sdpa_attention_forward`; steps with few queries over a long cache
  (decode, verify, draft) take a faster path on CPU (`small_q_attention`): the native one-pass kernel
  (`decoders.kernels`) where it applies, else two GEMMs around an in-place softmax.
- `record_visual_attention(span)` is a context manager: during forwards inside it, every decoder layer adds
  to `recorder.scores[layer_idx]` ([B, Hkv, n_visual]) the attention mass its queries put on the visual keys
  `span = (start, end)`, summed over the queries of the call and over each GQA query group. Only the new
  queries are scored (the prompt suffix in the two-stage prefill), never an L x L matrix.
- `watch_visual_attention(recorder)` is the cheap variant for decode-time steps on the lean path
  (`decoders.fastpath`): each layer stores in `recorder.scores[layer]` the visual attention mass of EACH
  new query ([B, Hkv, q, n_visual], summed over its GQA group), read off the probabilities the step computes
  anyway. In a verify pass the rows are the pending token and the drafts; once acceptance is known, the
  rows of the committed tokens are exactly the generated text's own attention: StD uses them to follow
  where the generated text looks (`StDConfig.refresh_every`). Recording forwards are not affected.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from decoders import kernels

ATTN_NAME = "vidspec_sdpa"
# Off the CPU, the attention's probabilities times values over at least PV_SPLIT_MIN keys is split into
# chunks of PV_SPLIT_CHUNK keys (one batched product per chunk, then a sum): cuBLAS serves that product with a
# few query rows by a small-N kernel that walks every key in one pass (`gemmSN_NN`, 0.74 ms a layer at 25.6k
# keys on an H200 in float32, ~100x what reading the values costs; session 26's `gpu-profile.json`)
PV_SPLIT_DEVICES = ("cuda",)
PV_SPLIT_MIN = 4096
PV_SPLIT_CHUNK = 256


@dataclass
class VisualAttentionRecorder:
    span: tuple[int, int]
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, Hkv, n_visual]


_recorder: contextvars.ContextVar[VisualAttentionRecorder | None] = contextvars.ContextVar(
    "vidspec_attention_recorder", default=None
)


_watch: contextvars.ContextVar[VisualAttentionRecorder | None] = contextvars.ContextVar(
    "vidspec_attention_watch", default=None
)


def recording_active() -> bool:
    return _recorder.get() is not None


def active_recorder() -> VisualAttentionRecorder | None:
    """The recorder of the enclosing `record_visual_attention`, if any."""
    return _recorder.get()


def active_watch() -> VisualAttentionRecorder | None:
    return _watch.get()


@contextmanager
def watch_visual_attention(rec: VisualAttentionRecorder) -> Iterator[VisualAttentionRecorder]:
    token = _watch.set(rec)
    try:
        yield rec
    finally:
        _watch.reset(token)


def watch_queries(rec: VisualAttentionRecorder, layer: int, probs: torch.Tensor, q: int) -> None:
    """probs [B, Hkv, g*q, kv] (the g query heads of each KV head side by side, q new queries each):
    store each query's mass on the visual keys, summed over its g heads, as scores[layer] [B, Hkv, q, n]."""
    b, hkv, gq, kv = probs.shape
    s, e = rec.span
    rec.scores[layer] = probs.view(b, hkv, gq // q, q, kv)[..., s:e].sum(dim=2)


@contextmanager
def record_visual_attention(span: tuple[int, int]) -> Iterator[VisualAttentionRecorder]:
    rec = VisualAttentionRecorder(span=span)
    token = _recorder.set(rec)
    try:
        yield rec
    finally:
        _recorder.reset(token)


def _record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
    rec = _recorder.get()
    layer = getattr(module, "layer_idx", None)
    if rec is None or layer is None:
        return
    b, hq, q, d = query.shape  # query: [B, Hq, q, D]; key: [B, Hkv, kv, D] (whole cache, new keys last)
    hkv, kv = key.shape[1], key.shape[2]
    group = hq // hkv
    scale = scaling if scaling is not None else d**-0.5
    qg = query.reshape(b, hkv, group * q, d)  # query heads of one KV head side by side
    logits = torch.matmul(qg.float(), key.float().transpose(-1, -2)) * scale  # [B, Hkv, group*q, kv]
    # causal: query i (of q new ones) sees keys up to kv - q + i
    row = torch.arange(q, device=query.device).repeat(group)  # [group*q]
    allowed = torch.arange(kv, device=query.device)[None, :] <= (kv - q + row)[:, None]  # [group*q, kv]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    s, e = rec.span
    mass = probs[..., s:e].sum(dim=2)  # [B, Hkv, n_visual]
    rec.scores[layer] = rec.scores[layer] + mass if layer in rec.scores else mass


SMALL_Q = 32  # decode and verify steps: at most this many new queries

# On CPU the [rows, kv] score matrix of `small_q_attention` is written into a per-thread scratch buffer and
# the softmax runs in place on it: no fresh allocation of megabytes per layer. Fresh ones are what glibc
# serves by mmap and hands back to the kernel on free, and on this VM the page faults of touching them again
# made a 5-row attention over 25.7k keys 3x slower in some runs (4.2 ms against 1.4 ms in one process). With
# the transposed keys of `decoders.cache`: 1.15-1.40x at 16k-26k keys, 1-8 rows (`benchmarks/key_layout.py`).
# Outputs are bitwise those of the allocating path (tested). The buffer keeps the largest score matrix a
# thread has needed (13 MB for a 32-token prompt suffix over 25.6k keys on the reference model).
REUSE_SCORES = True  # False only to measure the allocating path
# decode-time attention through the native one-pass kernel where it applies (`decoders.kernels`); False
# only to measure the torch path (or set VIDSPEC_ATTN_KERNEL=0 before the first step)
USE_KERNEL = True
SCRATCH_MIN = 1 << 15  # elements (128 KiB of float32, glibc's default mmap threshold); below it, allocate
_scratch = threading.local()


def _score_buffer(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous [shape] view of this thread's scratch buffer (grown by half again when too small)."""
    n = math.prod(shape)
    buf = getattr(_scratch, "scores", None)
    if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
        with torch.inference_mode(False):  # an ordinary tensor: usable in and out of inference mode
            buf = torch.empty(n + n // 2, dtype=like.dtype, device=like.device)
        _scratch.scores = buf
    return buf[:n].view(shape)


_FUTURE: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _future_mask(q: int, g: int, device: torch.device) -> torch.Tensor:
    """[g*q, q] True where query i (of q new ones, g heads side by side) would see a later new key."""
    key = (q, g, device)
    if key not in _FUTURE:
        _FUTURE[key] = torch.ones(q, q, dtype=torch.bool, device=device).triu(1).repeat(g, 1)
    return _FUTURE[key]


def small_q_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal_tail: bool = False,
    watch: tuple[VisualAttentionRecorder, int] | None = None,
) -> torch.Tensor:
    """Attention for a few queries over a long cache, GQA without repeating K/V.

    query [B, Hq, q, D]; key, value [B, Hkv, kv, D]; mask None or bool [B, 1, q, kv] (True = attend).
    Returns [B, q, Hq, D]. Without a mask or a watch, on CPU in float32 with the cache's key layout, it runs
    the native kernel (`decoders.kernels.attention`: one pass over K and V for all rows, online softmax,
    software prefetch); measured on the reference model, interleaved, a whole decode step 1.6-1.7x and a
    5-row verify 2.6-2.9x faster at 16k-25.6k visual tokens than the path below
    (`benchmarks/attn_kernel.py`, `benchmarks/results/attn-kernel.json`).
    Otherwise two matmuls around an in-place softmax: on CPU it reads K and V once with multithreaded
    GEMMs and is about 2x faster than the fused SDPA kernel for q = 1 at 16k-25k entries.
    `watch` = (recorder, layer): also store every query's visual mass (`watch_queries`).
    """
    b, hq, q, d = query.shape
    hkv, kv = key.shape[1], key.shape[2]
    g = hq // hkv
    # the g query heads of each KV head side by side; scaling the few query rows instead of the
    # [rows, kv] scores saves a full pass over the score matrix (~15% of a verify at 16k keys)
    qg = (query * scale).reshape(b, hkv, g * q, d)
    if USE_KERNEL and mask is None and watch is None and b == 1:
        # one pass over K and V for all rows (decoders.kernels); None when it does not apply here
        out = kernels.attention(qg[0], key, value, q if causal_tail else 1, torch.get_num_threads())
        if out is not None:
            return out.view(b, hq, q, d).transpose(1, 2)
    in_place = (
        REUSE_SCORES
        and qg.device.type == "cpu"
        and qg.dtype == torch.float32
        and b * hkv * g * q * kv >= SCRATCH_MIN  # small score matrices come cheaply from malloc's arena
    )
    out = _score_buffer((b, hkv, g * q, kv), qg) if in_place else None
    scores = torch.matmul(qg, key.transpose(-1, -2), out=out)  # [B, Hkv, g*q, kv]
    if mask is not None:
        m = mask.view(b, 1, 1, q, kv).expand(b, 1, g, q, kv).reshape(b, 1, g * q, kv)
        scores.masked_fill_(~m, float("-inf"))
    elif causal_tail and q > 1:
        scores[..., kv - q :].masked_fill_(_future_mask(q, g, scores.device), float("-inf"))
    if in_place:
        probs = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    if watch is not None:
        watch_queries(watch[0], watch[1], probs, q)
    out = probs_times_values(probs, value)  # [B, Hkv, g*q, D]
    return out.view(b, hq, q, d).transpose(1, 2)


def probs_times_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``probs [B, H, r, kv] @ value [B, H, kv, D]``, split over the keys where one product is slow (above)."""
    kv = value.shape[-2]
    if probs.device.type not in PV_SPLIT_DEVICES or kv < PV_SPLIT_MIN:
        return torch.matmul(probs, value)
    b, h, r, _ = probs.shape
    d, c = value.shape[-1], PV_SPLIT_CHUNK
    n = kv // c
    main = n * c
    p = probs[..., :main].reshape(b, h, r, n, c).transpose(2, 3)  # [B, H, n, r, c]
    v = value[..., :main, :].reshape(b, h, n, c, d)  # a view: the cache's keys are rows of D values
    # the partial products summed in float32 (in bf16 each chunk's product is rounded once, as a single
    # product's output is; the sum adds no further rounding until the result's own)
    out = torch.matmul(p, v).sum(dim=2, dtype=torch.float32)  # [B, H, r, D]
    if main < kv:
        out = out + torch.matmul(probs[..., main:], value[..., main:, :])
    return out.to(value.dtype)


def vidspec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    _record(module, query, key, scaling)
    q = query.shape[2]
    is_bool_mask = attention_mask is not None and attention_mask.dtype == torch.bool
    if q <= SMALL_Q and key.shape[2] >= 256 and ((q == 1 and attention_mask is None) or is_bool_mask):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return small_q_attention(query, key, value, attention_mask, scale), None
    # SDPA's kernels want contiguous keys; the cache stores them transposed on CPU (`decoders.cache`), and
    # a copy per prefill chunk is far cheaper than SDPA over strided keys (3x slower, measured)
    return sdpa_attention_forward(
        module, query, key.contiguous(), value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


AttentionInterface.register(ATTN_NAME, vidspec_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
