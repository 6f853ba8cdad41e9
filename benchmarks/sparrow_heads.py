"""Sparrow heads compared by acceptance on held-out worlds, at a fixed draft length (no timing involved).

For each eval world (seeds the training never used; the eval's short and long settings, offset by 100 from the
worlds `vidspec eval` scores), every head drafts for the four caption requests and every question of the
world, gamma fixed (so acceptance does not depend on the machine's speed); every answer is asserted
token-identical to vanilla. Reported per length and head: acceptance (accepted / drafted) and mean accepted
length (bonus counted).
With `--video V`, the same measurement on one given video (the four caption requests) at the frame counts
of `--max-frames` instead, e.g. the bench video at 1.5k and 25.6k visual tokens.
With `--worlds N`, the same on N held-out worlds drawn like the bench video (`vidspec make-video --duration
1700 --fps 2 --size 224x224`, seeds from WORLD_SEED0, never trained on): one video's answers are a small
sample, so this says whether the bench video is typical (with `--video` too, it is measured first and left
out of the pooled rows); rows per video and pooled per frame count, and the ratio of mean accepted length between the last and the first frame count, per video and pooled.
`--adaptive`: the draft length as `vidspec bench` sets it (the session's controller, fed measured costs,
start 6, at most 12) instead of a fixed `--gamma`; then the figures depend on this machine's timings.
Usage: python benchmarks/sparrow_heads.py --heads old=DIR1,new=DIR2 --short 10 --long 2
       python benchmarks/sparrow_heads.py --heads shipped=models/vidspec-reference --worlds 8 --adaptive
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
from decoders.train.eval import SETTINGS, eval_questions, eval_video
from decoders.train.reference import CAPTION_PROMPTS, EVAL_SEED0
from decoders.video import read_video

SEED_OFFSET = 100  # other worlds than the ones `vidspec eval` and the LVSpec sweep score
WORLD_SEED0 = EVAL_SEED0 + 200_000  # `--worlds`: held out, apart from every other benchmark's worlds


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
    p.add_argument(
        "--worlds", type=int, default=0, help="held-out worlds like the bench video, at --max-frames"
    )
    p.add_argument("--world-duration", type=float, default=1700.0, help="with --worlds: seconds of video")
    p.add_argument("--adaptive", action="store_true", help="draft length as vidspec bench sets it")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="answers per prompt and head (the controller learns across them)",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    lm = load_model(a.model)
    heads = {name: load_head(d, lm) for name, d in (x.split("=", 1) for x in a.heads.split(","))}
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    rows = []

    def measure(session: VisualSession, prompts: list[str], totals: dict[str, list[int]]) -> None:
        """Every head drafts for every prompt (`--repeats` times); answers asserted equal to vanilla."""
        refs = {q: run(session, lm.suffix_ids(q), cfg).tokens for q in prompts}
        for q in [q for _ in range(a.repeats) for q in prompts]:  # as the bench: prompts in turn, repeated
            ref = refs[q]
            for name, head in heads.items():
                proposer = (
                    SparrowProposer(head) if a.adaptive else SparrowProposer(head, a.gamma, adaptive=False)
                )
                out = run(session, lm.suffix_ids(q), cfg, proposer)
                if out.tokens != ref:
                    raise AssertionError(f"head {name}: answer differs from vanilla on {q!r}")
                t = totals[name]
                t[0] += out.stats.num_accepted_tokens
                t[1] += out.stats.num_draft_tokens
                t[2] += out.stats.num_drafts

    def add_rows(
        length: str,
        count: int,
        tokens: list[int],
        totals: dict[str, list[int]],
        max_frames: int | None = None,
    ) -> None:
        for name, (acc, drafted, cycles) in totals.items():
            rows.append(
                {
                    "length": length,
                    "max_frames": max_frames,
                    "videos": count,
                    "visual_tokens_mean": float(np.mean(tokens)),
                    "head": name,
                    "acceptance": acc / max(1, drafted),
                    "mean_accepted_length": 1 + acc / max(1, cycles),
                    "cycles": cycles,
                }
            )

    frames = common.frame_counts(a.max_frames)
    videos = [a.video] if a.video else []
    for i in range(a.worlds):
        seed = WORLD_SEED0 + i
        path = Path("runtime/bench-worlds") / f"world-{seed}-{a.world_duration:g}s.mp4"
        if not path.exists():
            W.make_video(path, a.world_duration, a.fps, 224, 224, seed)
        if str(path) != a.video:  # a world given as --video too is measured once, as --video
            videos.append(str(path))
    pooled: dict[int, dict[str, list[int]]] = {}
    pooled_tokens: dict[int, list[int]] = {}
    for vi, video in enumerate(videos, 1):  # given videos at several lengths, the caption requests only
        for mf in frames:
            session = common.session_at(lm, video, mf, a.fps)
            totals = {name: [0, 0, 0] for name in heads}  # accepted, drafted, cycles
            measure(session, list(CAPTION_PROMPTS), totals)
            add_rows(Path(video).name, 1, [session.num_visual_tokens], totals, mf)
            print(f"[{vi}/{len(videos)}] {Path(video).name} at {mf} frames: done", flush=True)
            if video == a.video:
                continue
            for name, t in totals.items():
                acc = pooled.setdefault(mf, {}).setdefault(name, [0, 0, 0])
                acc[:] = [x + y for x, y in zip(acc, t, strict=True)]
            pooled_tokens.setdefault(mf, []).append(session.num_visual_tokens)
    if a.worlds > 1:
        for mf, totals in pooled.items():
            add_rows("pooled", a.worlds, pooled_tokens[mf], totals, mf)
    ratios = _ratios(rows, frames) if videos else []
    for r in ratios:
        if r["video"] == "pooled":
            skip = Path(a.video).name if a.video else None
            r["ci95"] = pooled_ratio_ci(rows, frames, r["head"], skip=skip)
    settings = [] if videos else [(n, c) for n, c in (("short", a.short), ("long", a.long)) if c > 0]
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
            questions = [qa.question for qa in eval_questions(world, seed)]
            measure(session, [*CAPTION_PROMPTS, *questions], totals)
        add_rows(length, count, tokens, totals)
    print("| length | head | acceptance | mean accepted length | cycles |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['length']} ({r['videos']} videos, {r['visual_tokens_mean']:.0f} tok) | {r['head']} "
            f"| {r['acceptance']:.3f} | {r['mean_accepted_length']:.2f} | {r['cycles']} |"
        )
    for r in ratios:
        print(
            f"{r['video']} {r['head']}: accepted length {r['last']:.2f} / {r['first']:.2f} = {r['ratio']:.0%}"
        )
    doc = {"model": a.model, "gamma": "adaptive" if a.adaptive else a.gamma, "rows": rows, "ratios": ratios}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=2)


def _ratios(rows: list[dict], frames: list[int]) -> list[dict]:
    """Mean accepted length at the last frame count over the first, per video (and pooled) and head."""
    first, last = frames[0], frames[-1]
    by_key = {(r["length"], r["head"], r["max_frames"]): r for r in rows}
    out = []
    for (video, head, mf), r in by_key.items():
        lo = by_key.get((video, head, first))
        if mf != last or lo is None or first == last:
            continue
        ratio = r["mean_accepted_length"] / lo["mean_accepted_length"]
        out.append(
            {
                "video": video,
                "head": head,
                "first": lo["mean_accepted_length"],
                "last": r["mean_accepted_length"],
                "ratio": ratio,
            }
        )
    return out


def pooled_ratio_ci(
    rows: list[dict], frames: list[int], head: str, skip: str | None = None, n: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of the pooled ratio (last / first frame count), resampling whole videos (rows
    other than "pooled" and `skip`): the videos, not the cycles, are the sample."""
    first, last = frames[0], frames[-1]
    per = {}  # video -> (accepted, cycles) at the first and at the last frame count
    for r in rows:
        if r["head"] != head or r["length"] in ("pooled", skip) or r["max_frames"] not in (first, last):
            continue
        acc = round((r["mean_accepted_length"] - 1) * r["cycles"])
        per.setdefault(r["length"], {})[r["max_frames"]] = (acc, r["cycles"])
    vids = [v for v in per.values() if first in v and last in v]
    if not vids:
        return (float("nan"), float("nan"))
    a = np.array([[v[first][0], v[first][1], v[last][0], v[last][1]] for v in vids], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(vids), size=(n, len(vids)))
    s = a[idx].sum(axis=1)  # [n, 4]
    ratio = (1 + s[:, 2] / s[:, 3]) / (1 + s[:, 0] / s[:, 1])
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return (float(lo), float(hi))


if __name__ == "__main__":
    main()
