"""The draft-length controller shared by the prompts of a video against one started fresh for every prompt.

Timed side by side: at each length, vanilla, and Sparrow and StD each with the session's shared controller
(as shipped: `VisualSession.draft_controller`) and with a fresh one per prompt (the controllers are cleared
before every prompt), the four caption requests per repeat, methods interleaved repeat by repeat, medians of
decode time summed over the requests. Every answer is checked token-identical to vanilla.
Usage: python benchmarks/controller_sharing.py --max-frames 64,192,2048 --repeats 15
"""

from __future__ import annotations

import statistics

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch
from gamma_policy import QUESTIONS

from decoders.engine import run
from decoders.proposers.sparrow import SparrowProposer
from decoders.proposers.std import StDProposer
from decoders.sampling import DecodeConfig
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status

METHODS = ("vanilla", "sparrow-shared", "sparrow-fresh", "std-shared", "std-fresh")


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64,192,2048", "benchmarks/results/controller-sharing.json")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    cfg = DecodeConfig(max_new_tokens=96)
    prompts = [lm.suffix_ids(q) for q in QUESTIONS]
    out = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        want = [run(session, q, cfg).tokens for q in prompts]
        session.draft_controllers.clear()
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        counts: dict[str, list[int]] = {m: [0, 0] for m in METHODS}  # accepted, cycles with drafts
        for _ in range(a.repeats):
            for m in METHODS:
                total = 0.0
                for q, w in zip(prompts, want, strict=True):
                    if m.endswith("fresh"):
                        session.draft_controllers.clear()
                    prop = None
                    if m.startswith("sparrow"):
                        prop = SparrowProposer(head)
                    elif m.startswith("std"):
                        prop = StDProposer()
                    res = run(session, q, cfg, prop)
                    assert res.tokens == w, f"{m} changed an answer"
                    total += res.stats.decode_s
                    counts[m][0] += res.stats.num_accepted_tokens
                    counts[m][1] += res.stats.num_drafts
                times[m].append(total)
        base = statistics.median(times["vanilla"])
        row = {"visual_tokens": session.num_visual_tokens, "repeats": a.repeats}
        for m in METHODS:
            acc, cyc = counts[m]
            row[m] = {
                "decode_s": round(statistics.median(times[m]), 5),
                "speedup": round(base / statistics.median(times[m]), 3),
                "mean_accepted_length": round(1 + acc / cyc, 3) if cyc else None,
            }
        print(row, flush=True)
        out.append(row)
    doc = {"model": a.model, "video": a.video, "threads": a.threads, "blas": cpu_status(), "results": out}
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()
    main()
