"""Sparrow's greedy draft chain on a GPU: CUDA-graph replays against the same step eagerly and step by step.

`decoders/proposers/sparrow_graph.py` drafts a cycle's tokens after the first as replays of one captured CUDA
graph (session 26, written without a GPU). This measures, side by side in one process on the same sessions,
the shipped head on the reference model answering the four caption requests with the draft length fixed
(`--gamma`, so the arms draft alike and mainly their cost differs): `graph` (the default on CUDA), `eager`
(the fixed-shape step not captured, `EAGER_CHAIN`), `stepwise` (the per-step torch path, what
`VIDSPEC_CUDA_GRAPHS=0` gives), and vanilla; all with the torch draft path (on the CPU the native chain would
take over); interleaved and rotated per repeat. Every answer must equal vanilla's; whether the three arms
drafted the same (cycles and accepted counts; rounding may move a near-tie) is reported. Runs on the CPU too
(a dry run: nothing is captured there, so `graph` drafts step by step).
Usage: python benchmarks/gpu_sparrow_chain.py --device cuda [--video V] [--max-frames 64,192] [--json OUT]
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

from decoders.engine import run
from decoders.model import VideoLM, load_model
from decoders.proposers import sparrow_graph as SG
from decoders.proposers.router import draft_head
from decoders.proposers.sparrow import SparrowHead, SparrowProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.reference import CAPTION_PROMPTS
from pipeline.bench import DTYPES

ARMS = ("vanilla", "graph", "eager", "stepwise")


@dataclass
class Length:
    """One video length's session and what its arms did so far."""

    session: VisualSession
    times: dict[str, list[float]] = field(default_factory=lambda: {arm: [] for arm in ARMS})
    answers: dict[str, list[list[int]]] = field(default_factory=dict)
    cycles: dict[str, tuple[int, int]] = field(default_factory=dict)
    captured: dict[str, bool | None] = field(default_factory=dict)


def answer(arm: str, at: Length, setup: Setup) -> float:
    """Every prompt answered by one arm; checked against vanilla's answers; decode tokens per second."""
    lm, head = setup.lm, setup.head
    if arm == "vanilla":
        outs = [run(at.session, q, setup.cfg) for q in setup.prompts]
    else:
        SG.STATIC_CHAIN_DEVICES = () if arm == "stepwise" else (lm.device.type,)
        os.environ["VIDSPEC_CUDA_GRAPHS"] = "1" if arm == "graph" else "0"
        SG.EAGER_CHAIN = arm == "eager"  # the fixed-shape step, not captured
        head._static_chain = setup.chains.get(arm)  # each arm's own chain (captured or not), kept
        outs = [
            run(
                at.session,
                q,
                setup.cfg,
                SparrowProposer(head, gamma=setup.gamma, adaptive=False, native=False),
            )
            for q in setup.prompts
        ]
        chain = setup.chains[arm] = getattr(head, "_static_chain", None)
        at.captured[arm] = None if arm == "stepwise" or chain is None else chain.graph is not None
        at.cycles[arm] = (
            sum(o.stats.num_drafts for o in outs),
            sum(o.stats.num_accepted_tokens for o in outs),
        )
    at.answers.setdefault(arm, [o.tokens for o in outs])
    if [o.tokens for o in outs] != at.answers["vanilla"]:
        raise AssertionError(f"{arm} differs from vanilla at {at.session.num_visual_tokens} visual tokens")
    return sum(len(o.tokens) - 1 for o in outs) / sum(o.stats.decode_s for o in outs)


@dataclass
class Setup:
    lm: VideoLM
    head: SparrowHead
    cfg: DecodeConfig
    prompts: list[list[int]]
    gamma: int
    chains: dict[str, SG.StaticChain | None] = field(default_factory=dict)


def main() -> None:
    p = common.parser(__doc__, "64,192", "")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=96)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device=a.device, dtype=DTYPES[a.dtype])
    head = draft_head(lm)
    assert head is not None, "needs the model's Sparrow head"
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    setup = Setup(lm, head, cfg, [lm.suffix_ids(q) for q in CAPTION_PROMPTS], a.gamma)
    devices, eager, graphs_env = (
        SG.STATIC_CHAIN_DEVICES,
        SG.EAGER_CHAIN,
        os.environ.get("VIDSPEC_CUDA_GRAPHS"),
    )
    doc: dict = {
        "device": str(lm.device),
        "dtype": a.dtype,
        "gamma": a.gamma,
        "video": a.video,
        "lengths": [],
    }
    print("| visual tokens | arm | decode tok/s | speedup vs vanilla | tokens/cycle | graph captured |")
    print("|---:|---|---:|---:|---:|---|")
    try:
        for max_frames in common.frame_counts(a.max_frames):
            at = Length(common.session_at(lm, a.video, max_frames))
            for arm in ARMS:  # untimed: captures, kernel choices
                answer(arm, at, setup)
            for r in range(a.repeats):
                for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:  # interleaved, rotated
                    at.times[arm].append(answer(arm, at, setup))
            # the same drafts up to rounding (the chain attends over a masked fixed buffer: other GEMM shapes)
            same = len({at.cycles[arm] for arm in ARMS[1:]}) == 1
            if not same:
                print(f"note: the arms' (cycles, accepted) differ: {at.cycles}")
            base = statistics.median(at.times["vanilla"])
            row = {"visual_tokens": at.session.num_visual_tokens, "same_drafts": same, "arms": {}}
            for arm in ARMS:
                tps = statistics.median(at.times[arm])
                drafts, accepted = at.cycles.get(arm, (0, 0))
                per_cycle = (accepted + drafts) / drafts if drafts else None
                row["arms"][arm] = {
                    "tokens_per_s": tps,
                    "tokens_per_s_per_repeat": at.times[arm],
                    "speedup_vs_vanilla": tps / base,
                    "tokens_per_cycle": per_cycle,
                    "graph_captured": at.captured.get(arm),
                }
                cell = "-" if per_cycle is None else f"{per_cycle:.2f}"
                print(
                    f"| {at.session.num_visual_tokens} | {arm} | {tps:.1f} | {tps / base:.2f} | {cell} | "
                    f"{at.captured.get(arm, '-')} |",
                    flush=True,
                )
            doc["lengths"].append(row)
    finally:
        SG.STATIC_CHAIN_DEVICES, SG.EAGER_CHAIN = devices, eager
        if graphs_env is None:
            os.environ.pop("VIDSPEC_CUDA_GRAPHS", None)
        else:
            os.environ["VIDSPEC_CUDA_GRAPHS"] = graphs_env
    if a.json:
        common.write_json(a.json, doc)


if __name__ == "__main__":
    main()
