"""A Sparrow head's greedy one-row draft steps with fixed shapes and no host sync, replayed as a CUDA graph.

Contract:
- `StaticChain.create(head, lm)` builds, for one head and target, a draft step whose every tensor has a fixed
  shape and address: the head's K/V in buffers of `capacity` entries written at a position held on the
  device, attention over the whole buffer with the entries after that position masked, the next token chosen
  on the device (argmax) and fed back with the step's feature. `run(keys, values, length, token, feature, n)`
  copies the proposer's committed head entries (the first `length`) into those buffers, then drafts `n`
  tokens after `token` (the first draft, whose feature is `feature`) and returns them: one host sync per call.
- Why: on a GPU a draft step of this small head is ~30 kernel launches, each costing the host far more than
  the device's work (session 26, H200: 0.5-0.9 ms a draft step, ~half of a Sparrow cycle at 0.5k visual
  tokens). On CUDA one step is captured as a `torch.cuda.CUDAGraph` and replayed once per draft (one launch);
  where capture fails, or with `VIDSPEC_CUDA_GRAPHS=0`, there is no chain and drafts take the per-step path
  (the eager fixed-shape step attends over its whole buffer: only `EAGER_CHAIN`, for tests and A/Bs, uses it);
  a chain that cannot be made at all (its buffers, say) is not tried again for that target, and one whose
  buffers are too short for a call (`DEFAULT_CAPACITY` head entries) leaves that call to the per-step path.
- Only greedy drafts (sampling keeps the per-step path, which also records the draft distribution), and
  only where `STATIC_CHAIN_DEVICES` lists the device (CUDA; the CPU has the native chain). The tests force
  it on the CPU, eagerly (`EAGER_CHAIN`).
- Same function as `SparrowHead.step_rows` for one row, up to float rounding (attention over masked extra
  entries instead of a shorter cache); drafts are verified, so rounding never reaches the output. A draft
  that meets an end-of-sequence token is cut after it by the caller (the chain itself drafts on).
- One chain per head and target (kept on the head; made under a lock, captured on the target's device with a
  thread-local capture mode), used by one call at a time: a call that finds it busy (another thread) gets
  None and drafts step by step.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F

from decoders.model import VideoLM

logger = logging.getLogger(__name__)
STATIC_CHAIN_DEVICES = ("cuda",)
EAGER_CHAIN = False  # use a chain that was not captured (tests on the CPU; the GPU A/B's eager arm)
_MAKING = threading.Lock()
DEFAULT_CAPACITY = 4096  # head entries: prompt suffix + answer + one draft


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(1e-12)


class StaticChain:
    def __init__(self, head: object, lm: VideoLM, capacity: int) -> None:
        cfg = head.cfg
        dev, dtype = lm.device, lm.dtype
        self.head, self.lm, self.capacity = head, lm, capacity
        self.lean = head._lean_weights()
        embed = lm.text_model.embed_tokens.weight
        self.table = head.token_rows(embed)  # [V, H] or None (a large vocabulary: per-step rows)
        self.embed = embed
        cos, sin_signed = head.rope_tables(0, capacity, dev)  # slices of a table kept on the head
        self.cos, self.sin = cos.clone(), sin_signed.clone()
        shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=dev)
        self.values = torch.zeros(shape, dtype=dtype, device=dev)
        self.cols = torch.arange(capacity, device=dev)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.feat = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.i = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.lock = threading.Lock()
        self.refused_full = False  # a call found the buffer too short (logged once)

    @classmethod
    def create(cls, head: object, lm: VideoLM, capacity: int | None = None) -> StaticChain:
        chain = cls(head, lm, capacity or DEFAULT_CAPACITY)
        if lm.device.type == "cuda" and os.environ.get("VIDSPEC_CUDA_GRAPHS", "1") != "0":
            chain._capture()
        return chain

    def current(self, head: object, lm: VideoLM) -> bool:
        """Still built on this head's weights and this target's embeddings (training resets the former)."""
        return (
            lm is self.lm
            and getattr(head, "_lean", None) is self.lean
            and lm.text_model.embed_tokens.weight is self.embed
            and (self.table is None or (head._tokens is not None and head._tokens[1] is self.table))
        )

    def _capture(self) -> None:
        try:
            with torch.cuda.device(self.lm.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # allocations and kernel choices happen before capture
                        self.step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.step()
            self.graph = graph
        except Exception as exc:  # a capture the runtime refuses: the eager step computes the same
            logger.warning("Sparrow draft chain: CUDA graph capture failed (%s); drafting eagerly", exc)
            self.graph = None

    def step(self) -> None:
        """One draft: encode (feat, tok) at `pos`, attend, pick the next token; advance every state tensor."""
        cfg = self.head.cfg
        _, _, wfc_h, _, wqkv, bqkv, wo, wgu, wdown, on = self.lean
        nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.table is not None:
            rows = self.table.index_select(0, self.tok)  # [1, H]
        else:
            rows = self.head._token_half(F.embedding(self.tok, self.embed))
        x = torch.addmm(rows, self.feat, wfc_h)
        qk, v = torch.addmm(bqkv, _unit(x), wqkv).split([(nq + nkv) * d, nkv * d], dim=-1)
        qk = qk.view(1, 1, nq + nkv, d).transpose(1, 2)
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
        self.keys.index_copy_(2, self.pos, qk[:, nq:])
        self.values.index_copy_(2, self.pos, v.view(1, 1, nkv, d).transpose(1, 2))
        # the query heads of each KV head side by side, against the whole buffer; entries after pos masked
        f = torch.float32
        q = (qk[:, :nq].to(f) * d**-0.5).reshape(1, nkv, nq // nkv, d)
        scores = torch.matmul(q, self.keys.to(f).transpose(-1, -2))  # [1, nkv, g, capacity]
        scores = scores.masked_fill(self.cols > self.pos, float("-inf"))
        att = torch.matmul(torch.softmax(scores, dim=-1), self.values.to(f)).reshape(1, nq * d)
        x = torch.addmm(x, att.to(x.dtype), wo)
        gate, up = torch.mm(_unit(x), wgu).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate) * up, wdown)
        g = _unit(x) * on
        tok = torch.argmax(self.lm.logits(g), dim=-1)  # [1]
        self.out.index_copy_(0, self.i, tok)
        self.tok.copy_(tok)
        self.feat.copy_(g)
        self.pos.add_(1)
        self.i.add_(1)

    def run(
        self, keys: torch.Tensor, values: torch.Tensor, length: int, token: int, feature: torch.Tensor, n: int
    ) -> list[int] | None:
        """Draft n tokens after `token` (feature [.., H]) over the committed head entries keys/values
        [1, Hkv, >= length, D]; None when the buffers are too short or the chain is busy."""
        if n < 1:
            return None
        if length + n > self.capacity:
            if not self.refused_full:
                self.refused_full = True
                logger.info(
                    "Sparrow draft chain: %d head entries + %d drafts exceed its %d; drafting step by step",
                    length, n, self.capacity,
                )  # fmt: skip
            return None
        if not self.lock.acquire(blocking=False):
            return None
        try:
            self.keys[:, :, :length].copy_(keys[:, :, :length])
            self.values[:, :, :length].copy_(values[:, :, :length])
            self.tok.fill_(token)
            self.feat.copy_(feature.reshape(1, -1))
            self.pos.fill_(length)
            self.i.zero_()
            if self.graph is not None:
                with torch.cuda.device(self.lm.device):
                    for _ in range(n):
                        self.graph.replay()
            else:
                for _ in range(n):
                    self.step()
            return self.out[:n].tolist()
        finally:
            self.lock.release()


def static_chain(head: object, lm: VideoLM) -> StaticChain | None:
    """The head's chain for this target (made and captured on first use, kept on the head), or None where it
    does not apply: another device, graphs switched off, a capture that failed (unless `EAGER_CHAIN`)."""
    if lm.device.type not in STATIC_CHAIN_DEVICES or (
        lm.device.type == "cuda" and os.environ.get("VIDSPEC_CUDA_GRAPHS", "1") == "0" and not EAGER_CHAIN
    ):
        return None
    with _MAKING:
        chain = getattr(head, "_static_chain", None)
        if isinstance(chain, _Failed):
            if chain.lm is lm:
                return None
            chain = _make(head, lm)
        elif chain is None or not chain.current(head, lm):
            chain = _make(head, lm)
    return chain if chain is not None and (chain.graph is not None or EAGER_CHAIN) else None


class _Failed:
    """A chain that could not be made for this target (not retried for it)."""

    def __init__(self, lm: VideoLM) -> None:
        self.lm = lm


def _make(head: object, lm: VideoLM) -> StaticChain | None:
    try:
        chain = StaticChain.create(head, lm)
    except Exception as exc:  # e.g. out of device memory for its buffers: the per-step path still drafts
        logger.warning("Sparrow draft chain: not made (%s); drafting step by step", exc)
        head._static_chain = _Failed(lm)
        return None
    head._static_chain = chain
    return chain
