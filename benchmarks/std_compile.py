"""StD with its draft step compiled (`StDConfig.compile_draft`) against StD as shipped, side by side with vanilla.

At each length one session is prefilled once; vanilla, StD (eager draft) and StD (compiled draft) answer the
four caption requests, interleaved over `--repeats` (the compile happens in an untimed warm-up first). Both
StD variants verify eagerly, so every answer must be token-identical to vanilla (asserted). Reported per
length and variant: decode tok/s (median over repeats of the summed decode time), speedup over vanilla, mean
accepted length, draft step ms (median per cycle), verify ms.
Usage: python benchmarks/std_compile.py --max-frames 128,2048,3200 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from decoders.engine import SpecDecodeStats, run
from decoders.model import load_model
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.reference import CAPTION_PROMPTS
from decoders.video import read_video
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status

VARIANTS = {"vanilla": None, "std": StDConfig(), "std-compiled-draft": StDConfig(compile_draft=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--video", default="runtime/ref-long.mp4")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", default="128,2048,3200")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--json", default="benchmarks/results/std-compile.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    lm = load_model(a.model)
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    prompts = [lm.suffix_ids(q) for q in CAPTION_PROMPTS]
    rows = []
    for i, mf in enumerate(int(x) for x in a.max_frames.split(",")):
        sampling = lm.default_sampling(fps=a.fps, max_frames=mf)
        session = VisualSession.create(lm, lm.prepare_video(read_video(a.video, sampling), sampling))
        if i == 0:
            t0 = time.perf_counter()
            run(session, prompts[0], cfg, StDProposer(VARIANTS["std-compiled-draft"]))
            print(f"compiled the draft step in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        vanilla = [run(session, q, cfg).tokens for q in prompts]
        decode: dict[str, list[float]] = {v: [] for v in VARIANTS}
        stats: dict[str, list[SpecDecodeStats]] = {v: [] for v in VARIANTS}
        for _ in range(a.repeats):
            for name, std in VARIANTS.items():  # interleaved: drift hits every variant alike
                parts = []
                for q, ref in zip(prompts, vanilla):
                    out = run(session, q, cfg, None if std is None else StDProposer(std))
                    if out.tokens != ref:
                        raise AssertionError(f"{name}: answer differs from vanilla")
                    parts.append(out.stats)
                s = SpecDecodeStats.combined(parts)
                decode[name].append(s.decode_s)
                stats[name].append(s)
        tokens = sum(len(t) - 1 for t in vanilla)  # decoded after the first token
        base = statistics.median(decode["vanilla"])
        for name in VARIANTS:
            med = statistics.median(decode[name])
            last = stats[name][-1]
            cycles = [s.num_steps for s in stats[name]]
            row = {
                "visual_tokens": session.num_visual_tokens,
                "variant": name,
                "decode_tokens_per_s": tokens / med,
                "speedup_vs_vanilla": base / med,
                "mean_accepted_length": last.mean_accepted_length,
                "draft_step_ms": statistics.median(
                    1e3 * s.draft_s / max(1, s.num_draft_tokens) for s in stats[name]
                )
                if name != "vanilla"
                else None,
                "verify_ms": statistics.median(1e3 * s.verify_s / max(1, s.num_steps) for s in stats[name]),
                "cycles": statistics.median(cycles),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        "| visual tokens | variant | decode tok/s | speedup vs vanilla | mean accepted length | draft step | verify |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        step = "-" if r["draft_step_ms"] is None else f"{r['draft_step_ms']:.2f} ms"
        print(
            f"| {r['visual_tokens']} | {r['variant']} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['speedup_vs_vanilla']:.2f}x | {mal} | {step} | {r['verify_ms']:.2f} ms |"
        )
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "repeats": a.repeats, "blas": cpu_status(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
