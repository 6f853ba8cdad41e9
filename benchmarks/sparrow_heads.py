"""Sparrow heads compared by acceptance on held-out worlds, at a fixed draft length (no timing involved).

For each eval world (seeds the training never used; the eval's short and long settings, offset by 100 from the
worlds `vidspec eval` scores), every head drafts for the four caption requests and every question of the
world, gamma fixed (so acceptance does not depend on the machine's speed); every answer is asserted
token-identical to vanilla. Reported per length and head: acceptance (accepted / drafted) and mean accepted
length (bonus counted).
With `--video V`, the same measurement on one given video (the four caption requests) at the frame counts
of `--max-frames` instead, e.g. the bench video at 1.5k and 25.6k visual tokens.
Usage: python benchmarks/sparrow_heads.py --heads old=DIR1,new=DIR2 --short 10 --long 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import numpy as np
import torch

from decoders.engine import run
from decoders.model import load_model
from decoders.proposers.sparrow import SparrowProposer, load_head
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train import world as W
from decoders.train.eval import SETTINGS, eval_video
from decoders.train.reference import CAPTION_PROMPTS, EVAL_SEED0
from decoders.video import read_video

SEED_OFFSET = 100  # other worlds than the ones `vidspec eval` and the LVSpec sweep score


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--heads", required=True, help="name=dir,... (dir holds sparrow/)")
    p.add_argument("--short", type=int, default=10)
    p.add_argument("--long", type=int, default=2)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--json", default="benchmarks/results/sparrow-heads.json")
    p.add_argument(
        "--video", help="instead of held-out worlds: this video, caption requests, at --max-frames"
    )
    p.add_argument("--max-frames", default="192,3200", help="with --video: frame counts (2 fps: 1.5k, 25.6k)")
    p.add_argument("--fps", type=float, default=2.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    lm = load_model(a.model)
    heads = {name: load_head(d, lm) for name, d in (x.split("=", 1) for x in a.heads.split(","))}
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    rows = []

    def measure(session: VisualSession, prompts: list[str], totals: dict[str, list[int]]) -> None:
        """Every head drafts for every prompt at the fixed gamma; answers asserted equal to vanilla."""
        for q in prompts:
            ref = run(session, lm.suffix_ids(q), cfg).tokens
            for name, head in heads.items():
                out = run(
                    session, lm.suffix_ids(q), cfg, SparrowProposer(head, gamma=a.gamma, adaptive=False)
                )
                if out.tokens != ref:
                    raise AssertionError(f"head {name}: answer differs from vanilla on {q!r}")
                t = totals[name]
                t[0] += out.stats.num_accepted_tokens
                t[1] += out.stats.num_draft_tokens
                t[2] += out.stats.num_drafts

    def add_rows(length: str, count: int, tokens: list[int], totals: dict[str, list[int]]) -> None:
        for name, (acc, drafted, cycles) in totals.items():
            rows.append(
                {
                    "length": length,
                    "videos": count,
                    "visual_tokens_mean": float(np.mean(tokens)),
                    "head": name,
                    "acceptance": acc / max(1, drafted),
                    "mean_accepted_length": 1 + acc / max(1, cycles),
                    "cycles": cycles,
                }
            )

    if a.video:  # one given video at several lengths, the caption requests only
        for mf in common.frame_counts(a.max_frames):
            session = common.session_at(lm, a.video, mf, a.fps)
            totals = {name: [0, 0, 0] for name in heads}  # accepted, drafted, cycles
            measure(session, list(CAPTION_PROMPTS), totals)
            add_rows(Path(a.video).name, 1, [session.num_visual_tokens], totals)
    settings = [] if a.video else [(n, c) for n, c in (("short", a.short), ("long", a.long)) if c > 0]
    for length, count in settings:
        setting = SETTINGS[length]
        totals = {name: [0, 0, 0] for name in heads}
        tokens = []
        for i in range(count):
            seed = EVAL_SEED0 + setting.seed_offset + SEED_OFFSET + i
            world, path = eval_video(setting, seed, Path("runtime/eval"))
            sampling = lm.default_sampling(fps=setting.fps, max_frames=setting.max_frames)
            session = VisualSession.create(lm, lm.prepare_video(read_video(path, sampling), sampling))
            tokens.append(session.num_visual_tokens)
            questions = [qa.question for qa in W.questions(world, np.random.default_rng([seed, 11]))]
            measure(session, [*CAPTION_PROMPTS, *questions], totals)
        add_rows(length, count, tokens, totals)
    print("| length | head | acceptance | mean accepted length | cycles |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['length']} ({r['videos']} videos, {r['visual_tokens_mean']:.0f} tok) | {r['head']} "
            f"| {r['acceptance']:.3f} | {r['mean_accepted_length']:.2f} | {r['cycles']} |"
        )
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "gamma": a.gamma, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
