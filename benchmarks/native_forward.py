"""The native forward (the default) against the torch ops, for vanilla, Sparrow and StD side by side.

`FastDecoder.native_forward` runs vanilla steps and verify passes of up to `NativeStep.max_rows` tokens
through `vidspec_stepn` (decoders/kernels/attn.cpp) instead of the torch ops (`VIDSPEC_NATIVE_FORWARD=0` /
`vidspec bench --torch-forward`). It makes our vanilla, the baseline of every speedup in the README, faster,
so every ratio moves. This script measures vanilla, Sparrow and StD with the torch forward and with the native
one, interleaved repeat by repeat, on the bench video's four caption requests; every answer is asserted
token-identical to the torch forward's vanilla.
Usage: python benchmarks/native_forward.py --max-frames 64,192,3200 --repeats 3
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
    p = common.parser(__doc__, "64,192,3200", "benchmarks/results/native-forward.json")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    cfg = DecodeConfig(max_new_tokens=96)
    makers = {"vanilla": lambda: None, "sparrow": lambda: SparrowProposer(head), "std": lambda: StDProposer()}
    rows = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        prompts = [lm.suffix_ids(q) for q in CAPTION_PROMPTS]
        lm.fast.native_forward = False
        ref = [run(session, q, cfg).tokens for q in prompts]
        speeds: dict[tuple[bool, str], list[float]] = {}
        try:
            for _ in range(a.repeats):
                for native in (False, True):
                    lm.fast.native_forward = native
                    for name, make in makers.items():
                        what = f"{name} (native forward {native})"
                        tps = common.answers_tokens_per_s(session, prompts, cfg, make, ref, what)
                        speeds.setdefault((native, name), []).append(tps)
        finally:
            lm.fast.native_forward = False
        torch_vanilla = statistics.median(speeds[(False, "vanilla")])
        for native in (False, True):
            base = statistics.median(speeds[(native, "vanilla")])
            for name in makers:
                tps = statistics.median(speeds[(native, name)])
                rows.append(
                    {
                        "visual_tokens": session.num_visual_tokens,
                        "forward": "native" if native else "torch",
                        "method": name,
                        "tokens_per_s": tps,
                        "speedup_vs_same_forward_vanilla": tps / base,
                        "speedup_vs_torch_vanilla": tps / torch_vanilla,
                    }
                )
                print(
                    f"{session.num_visual_tokens:>6} {rows[-1]['forward']:<6} {name:<8} {tps:8.1f} tok/s "
                    f"{tps / base:.2f}x its vanilla, {tps / torch_vanilla:.2f}x torch vanilla",
                    flush=True,
                )
    common.write_json(a.json, {"model": a.model, "video": a.video, "threads": a.threads, "rows": rows})


if __name__ == "__main__":
    main()
