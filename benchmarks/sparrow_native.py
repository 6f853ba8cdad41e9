"""Sparrow's drafts as one native call per cycle against one torch step per token, side by side.

On the bench video at the given frame counts, vanilla, Sparrow with torch draft steps (`native=False`) and
Sparrow with the native chain (`decoders.kernels.NativeSparrow`, the default) answer the four caption
requests, interleaved repeat by repeat (the running order rotates); every answer is asserted token-identical
to vanilla. Reported per length and method: median decode speed, speedup over vanilla (ratio of medians),
draft time per drafted token, verify time per emitted token, mean accepted length and acceptance.
With `--chain-lib`, an earlier build of the kernel library runs the native chain in one more arm,
`sparrow-earlier-chain` (an A/B of chain kernels inside full decoding; the earlier build must take the current
weight layout); `--arms` picks the arms.
Usage: python benchmarks/sparrow_native.py --max-frames 64,192,3200 --repeats 7
"""

from __future__ import annotations

import statistics

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)

from decoders import kernels
from decoders.engine import run
from decoders.proposers.sparrow import SparrowProposer
from decoders.sampling import DecodeConfig
from decoders.train.reference import CAPTION_PROMPTS


def main() -> None:
    p = common.parser(__doc__, "64,192,3200", "benchmarks/results/sparrow-native.json")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--chain-lib", help="an earlier build of the kernel library: one more arm")
    p.add_argument("--arms", default="vanilla,sparrow-torch-draft,sparrow-native-draft")
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    chain = kernels.NativeSparrow.create(head, lm)
    head._native_chain = (lm, chain)  # the proposers' cached chain: its library is swapped per arm
    current = chain.lib if chain is not None else None

    def sparrow(lib: object) -> SparrowProposer:
        chain.lib = lib
        return SparrowProposer(head)

    makers = {
        "vanilla": lambda: None,
        "sparrow-torch-draft": lambda: SparrowProposer(head, native=False),
        "sparrow-native-draft": lambda: sparrow(current),
    }
    if a.chain_lib:
        earlier = common.earlier_build(
            a.chain_lib, current, ("vidspec_sparrow_chain", "vidspec_sparrow_scratch")
        )
        makers["sparrow-earlier-chain"] = lambda: sparrow(earlier)
    arms = a.arms.split(",") + (["sparrow-earlier-chain"] if a.chain_lib else [])
    makers = {name: makers[name] for name in arms}
    rows = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        prompts = [lm.suffix_ids(q) for q in CAPTION_PROMPTS]
        ref = [run(session, q, cfg).tokens for q in prompts]
        runs: dict[str, list[dict]] = {name: [] for name in makers}
        names = list(makers)
        for rep in range(a.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                outs = [run(session, q, cfg, makers[name]()) for q in prompts]
                if [o.tokens for o in outs] != ref:
                    raise AssertionError(f"{name} differs from vanilla at {mf} frames")
                st = [o.stats for o in outs]
                runs[name].append(
                    {
                        "tokens": sum(len(o.tokens) for o in outs),
                        "decode_s": sum(s.decode_s for s in st),
                        "draft_s": sum(s.draft_s for s in st),
                        "verify_s": sum(s.verify_s for s in st),
                        "drafted": sum(s.num_draft_tokens for s in st),
                        "accepted": sum(s.num_accepted_tokens for s in st),
                        "cycles": sum(s.num_drafts for s in st),
                    }
                )
        base = statistics.median(r["tokens"] / r["decode_s"] for r in runs["vanilla"])
        for name, rs in runs.items():
            tps = statistics.median(r["tokens"] / r["decode_s"] for r in rs)
            last = rs[-1]
            row = {
                "max_frames": mf,
                "visual_tokens": session.num_visual_tokens,
                "method": name,
                "repeats": len(rs),
                "tokens_per_s": tps,
                "speedup_vs_vanilla": tps / base,
                "draft_ms_per_drafted_token": (
                    1e3 * statistics.median(r["draft_s"] / r["drafted"] for r in rs)
                    if last["drafted"]
                    else None
                ),
                "verify_ms_per_token": 1e3 * statistics.median(r["verify_s"] / r["tokens"] for r in rs),
                "mean_accepted_length": 1 + last["accepted"] / last["cycles"] if last["cycles"] else None,
                "acceptance": last["accepted"] / last["drafted"] if last["drafted"] else None,
            }
            rows.append(row)
            print(
                f"{session.num_visual_tokens:>6} {name:<22} {tps:8.1f} tok/s {row['speedup_vs_vanilla']:.2f}x "
                f"draft {row['draft_ms_per_drafted_token'] or 0:.3f} ms/drafted, verify {row['verify_ms_per_token']:.3f}"
                f" ms/token, tau {row['mean_accepted_length'] or 0:.2f}",
                flush=True,
            )
    doc = {"model": a.model, "video": a.video, "threads": a.threads, "chain_lib": a.chain_lib, "rows": rows}
    common.write_json(a.json, doc)


if __name__ == "__main__":
    main()
