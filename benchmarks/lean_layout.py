"""The lean forward's weight layout, side by side: [out, in] weights through 3-D `F.linear` (the layout before
2026-12-03) against [in, out] weights through 2-D `addmm` (the current `FastDecoder`).

Both compute the reference model's decoder stack + logits for n new tokens on a real session (the video's
prefix and the prompt in the dense cache), interleaved call by call; median times per row count, and the
largest difference between the two hidden states.
Usage: python benchmarks/lean_layout.py --max-frames 64,2048 --rows 1,2,3,5,8
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch
import torch.nn.functional as F

from decoders.attention import small_q_attention
from decoders.cache import KVCache
from decoders.fastpath import FastDecoder, rms_norm, rope_signed
from decoders.model import VideoLM, load_model
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status


class OldLayout:
    """The previous lean forward: projection weights as transformers stores them, 3-D F.linear."""

    def __init__(self, lm: VideoLM, fast: FastDecoder) -> None:
        self.fast, self.lm = fast, lm
        self.layers = [
            (w1, e1, wqkv.t().contiguous(), bqkv, wo.t().contiguous(), w2, e2, wgu.t().contiguous(),
             wd.t().contiguous(), s)
            for (w1, e1, wqkv, bqkv, wo, w2, e2, wgu, wd, s) in fast.layers
        ]  # fmt: skip

    def forward(self, input_ids: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        fd = self.fast
        n = input_ids.shape[1]
        x = F.embedding(input_ids, fd.embed)
        pos = torch.arange(start, start + n, dtype=torch.float32)
        freqs = pos[:, None] * fd.inv_freq[None, :]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(x.dtype)
        sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(x.dtype)
        nq, nkv, d = fd.nq, fd.nkv, fd.d
        for i, (w1, e1, wqkv, bqkv, wo, w2, e2, wgu, wdown, scale) in enumerate(self.layers):
            y = rms_norm(x, w1, e1)
            qk, v = F.linear(y, wqkv, bqkv).split([(nq + nkv) * d, nkv * d], dim=-1)
            qk = rope_signed(qk.view(1, n, nq + nkv, d).transpose(1, 2), cos, sin)
            keys, values = cache.layers[i].update(qk[:, nq:], v.view(1, n, nkv, d).transpose(1, 2))
            attn = small_q_attention(qk[:, :nq], keys, values, None, scale, causal_tail=True)
            x = x + F.linear(attn.reshape(1, n, nq * d), wo)
            gate, up = F.linear(rms_norm(x, w2, e2), wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wdown)
        return rms_norm(x, fd.norm_w, fd.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(hidden).float()


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64,2048", "benchmarks/results/lean-layout.json")
    p.add_argument("--rows", default="1,2,3,5,8")
    p.add_argument("--calls", type=int, default=400)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device="cpu")
    assert lm.fast is not None, "the reference model runs on the lean path"
    new, old = lm.fast, OldLayout(lm, lm.fast)
    out = []
    for session in common.prompted_sessions(lm, a.video, a.max_frames):
        length = session.length
        start = length + session.rope_delta
        for n in [int(x) for x in a.rows.split(",")]:
            ids = torch.arange(40, 40 + n)[None]
            times: dict[str, list[float]] = {"old": [], "new": []}
            hidden = {}
            for _ in range(a.calls):
                for name, dec in (("old", old), ("new", new)):
                    t = time.perf_counter()
                    h = dec.forward(ids, start, session.cache)
                    dec.logits(h[0])
                    times[name].append(time.perf_counter() - t)
                    hidden[name] = h
                    session.truncate(length)
            o, nw = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
            row = {
                "visual_tokens": session.num_visual_tokens,
                "new_tokens": n,
                "old_ms": round(o, 3),
                "new_ms": round(nw, 3),
                "speedup": round(o / nw, 3),
                "max_abs_diff": float((hidden["old"] - hidden["new"]).abs().max()),
            }
            print(row, flush=True)
            out.append(row)
    doc = {"model": a.model, "threads": a.threads, "blas": cpu_status(), "calls": a.calls, "results": out}
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
