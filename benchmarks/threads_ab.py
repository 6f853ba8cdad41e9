"""The native forward on several threads: this build's stack split against an earlier build, in full decoding.

Since session 23 `vidspec_stepn` splits the whole stack among `--threads` threads (projection columns, KV
heads, rows); before, only the attention of the KV heads ran in parallel. This script answers the bench
video's four caption requests with vanilla, Sparrow and StD through the current library and through an
earlier build (`--lib`, swapped into the same `NativeStep`; it must take the current weight layout),
interleaved repeat by repeat, at the given thread count; every answer is asserted token-identical to the
first vanilla run. Reported per length, build and method: median decode tokens per second, the speedup over
the same build's vanilla, and the current build's speed over the earlier one's.
Usage: python benchmarks/threads_ab.py --threads 2 --lib .venv/lib/vidspec-kernels/vidspec_attn-<earlier>.so
"""

from __future__ import annotations

import statistics

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)

from decoders.engine import run
from decoders.proposers.sparrow import SparrowProposer
from decoders.proposers.std import StDProposer
from decoders.sampling import DecodeConfig
from decoders.train.reference import CAPTION_PROMPTS


def main() -> None:
    p = common.parser(__doc__, "64,192,2048,3200", "benchmarks/results/threads-ab.json")
    p.add_argument("--lib", required=True, help="an earlier build of the kernel library")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    native = lm.fast.native_step()
    assert native is not None, "needs the native kernels"
    current = native.lib
    earlier = common.earlier_build(a.lib, current, ("vidspec_stepn", "vidspec_stepn_scratch"))
    builds = {"current": current, "earlier": earlier}
    cfg = DecodeConfig(max_new_tokens=96)
    makers = {"vanilla": lambda: None, "sparrow": lambda: SparrowProposer(head), "std": lambda: StDProposer()}
    rows = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        prompts = [lm.suffix_ids(q) for q in CAPTION_PROMPTS]
        ref = [run(session, q, cfg).tokens for q in prompts]
        speeds: dict[tuple[str, str], list[float]] = {}
        try:
            for rep in range(a.repeats):
                order = list(builds) if rep % 2 == 0 else list(reversed(builds))
                for build in order:
                    native.lib = builds[build]
                    native._scratch_need.clear()  # scratch sizes may differ between builds
                    for name, make in makers.items():
                        what = f"{name} ({build} build)"
                        tps = common.answers_tokens_per_s(session, prompts, cfg, make, ref, what)
                        speeds.setdefault((build, name), []).append(tps)
        finally:
            native.lib = current
            native._scratch_need.clear()
        for build in builds:
            base = statistics.median(speeds[(build, "vanilla")])
            for name in makers:
                tps = statistics.median(speeds[(build, name)])
                over = tps / statistics.median(speeds[("earlier", name)])
                rows.append(
                    {
                        "visual_tokens": session.num_visual_tokens,
                        "build": build,
                        "method": name,
                        "tokens_per_s": tps,
                        "speedup_vs_same_build_vanilla": tps / base,
                        "over_earlier_build": over,
                    }
                )
                print(
                    f"{session.num_visual_tokens:>6} {build:<8} {name:<8} {tps:8.1f} tok/s "
                    f"{tps / base:.2f}x its vanilla, {over:.2f}x the earlier build",
                    flush=True,
                )
    doc = {"model": a.model, "video": a.video, "threads": a.threads, "earlier_lib": a.lib, "rows": rows}
    common.write_json(a.json, doc)


if __name__ == "__main__":
    main()
