"""StD's draft step, isolated: does its cost grow with the video? (the in-cycle figure mixes in cache misses)

In `vidspec bench` a draft step runs right after a verify pass that streamed the whole dense KV (tens of MB at
16k+ visual tokens) through the CPU caches, so the draft's weights and compact cache start cold. Here the
draft steps run back to back on the compact cache built by StD's prefill (the prompt's top-K entries + text),
at each length, interleaved over repeats: the cost of the step itself. Also reported: the same steps with the
dense verify forward in between (the in-cycle condition).
Usage: python benchmarks/std_draft_step.py --max-frames 128,3200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decoders.model import load_model
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.video import read_video
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--video", default="runtime/ref-long.mp4")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", default="128,3200")
    p.add_argument("--question", default="describe the video .")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/std-draft-step.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    cfg = DecodeConfig(max_new_tokens=64)
    setups = []
    for mf in (int(x) for x in a.max_frames.split(",")):
        sampling = lm.default_sampling(fps=a.fps, max_frames=mf)
        session = VisualSession.create(lm, lm.prepare_video(read_video(a.video, sampling), sampling))
        prop = StDProposer(StDConfig(gamma=a.gamma, adaptive=False))
        hidden = prop.prefill(session, lm.suffix_ids(a.question), cfg)
        pending = int(lm.logits(hidden[0, -1]).argmax())
        setups.append((session, prop, pending))
    times: dict[int, dict[str, list[float]]] = {
        s.num_visual_tokens: {"alone": [], "after_verify": []} for s, _, _ in setups
    }
    for _ in range(a.repeats):
        for session, prop, pending in setups:
            for mode in ("alone", "after_verify"):
                total = 0.0
                for _ in range(a.cycles):
                    if mode == "after_verify":  # a dense forward of gamma + 1 rows, rolled back
                        base = session.length
                        session.extend([pending] * (a.gamma + 1))
                        session.truncate(base)
                    t0 = time.perf_counter()
                    prop.propose(pending, a.gamma)
                    total += time.perf_counter() - t0
                    prop.draft_cache.truncate(prop.committed)
                times[session.num_visual_tokens][mode].append(total / (a.cycles * a.gamma))
    rows = []
    print(
        "| visual tokens | draft cache entries | draft step, back to back | draft step, after a dense verify |"
    )
    print("|---:|---:|---:|---:|")
    for (_session, prop, _), (n, t) in zip(setups, times.items()):
        row = {
            "visual_tokens": n,
            "draft_cache_entries": prop.committed,
            "alone_ms": 1e3 * statistics.median(t["alone"]),
            "after_verify_ms": 1e3 * statistics.median(t["after_verify"]),
        }
        rows.append(row)
        print(
            f"| {n} | {row['draft_cache_entries']} | {row['alone_ms']:.2f} ms | {row['after_verify_ms']:.2f} ms |"
        )
    lo, hi = rows[0], rows[-1]
    for k in ("alone_ms", "after_verify_ms"):
        print(f"{k}: {hi['visual_tokens']} vs {lo['visual_tokens']} visual tokens: {hi[k] / lo[k]:.2f}x")
    with open(a.json, "w") as f:
        json.dump(
            {
                "model": a.model,
                "gamma": a.gamma,
                "cycles": a.cycles,
                "repeats": a.repeats,
                "blas": cpu_status(),
                "rows": rows,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
