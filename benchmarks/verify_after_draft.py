"""Why a verify inside a Sparrow cycle costs more than the same forward timed back to back.

On a real session of the reference model, a forward + logits of n new tokens is timed in two conditions,
alternating blocks: back to back (the same forward repeated, as vanilla decoding runs), and right after k
draft-head steps (as in a speculative cycle). Same work, same cache length; only what ran just before differs.
Usage: python benchmarks/verify_after_draft.py --max-frames 64 --rows 1,5 --head-steps 4
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

from decoders.proposers.sparrow import HeadKV
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64", "benchmarks/results/verify-after-draft.json")
    p.add_argument("--rows", default="1,5")
    p.add_argument("--head-steps", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--blocks", type=int, default=2, help="alternating blocks per condition")
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    kv = HeadKV.empty(head.cfg, 256, lm.dtype, lm.device)
    emb = torch.randn(1, 1, lm.hidden_size)
    feat = torch.randn(1, 1, lm.hidden_size)

    def head_steps() -> None:
        kv.length = 16
        for _ in range(a.head_steps):
            lm.logits(head.step(emb, feat, kv)[0, -1])

    out = []
    for session in common.prompted_sessions(lm, a.video, a.max_frames):
        n0 = session.length
        for n in common.frame_counts(a.rows):
            ids = list(range(40, 40 + n))
            times: dict[str, list[float]] = {"back_to_back": [], "after_head_steps": []}
            for _ in range(a.blocks):
                for cond in times:
                    for _ in range(a.calls):
                        if cond == "after_head_steps":
                            head_steps()
                        t = time.perf_counter()
                        lm.logits(session.extend(ids)[0])
                        times[cond].append(time.perf_counter() - t)
                        session.truncate(n0)
            b2b, after = (statistics.median(times[c]) * 1e3 for c in times)
            row = {
                "visual_tokens": session.num_visual_tokens,
                "rows": n,
                "back_to_back_ms": round(b2b, 3),
                "after_head_steps_ms": round(after, 3),
                "ratio": round(after / b2b, 3),
            }
            print(row, flush=True)
            out.append(row)
    doc = {
        "model": a.model,
        "threads": a.threads,
        "blas": cpu_status(),
        "head_steps": a.head_steps,
        "results": out,
    }
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
