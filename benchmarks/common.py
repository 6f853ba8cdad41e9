"""Shared pieces of the benchmark scripts: the usual arguments, and a session at a given frame count."""

from __future__ import annotations

import argparse
import ctypes
import json
from collections.abc import Callable, Iterator

import torch

from decoders.engine import Proposer, run
from decoders.model import VideoLM, load_model
from decoders.proposers.router import draft_head
from decoders.proposers.sparrow import SparrowHead
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.world import WorldSpec
from decoders.video import read_video


def parser(doc: str, max_frames: str, json_out: str) -> argparse.ArgumentParser:
    """--model, --video, --max-frames, --threads, --json with this script's defaults."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--video", default="runtime/ref-long.mp4")
    p.add_argument("--max-frames", default=max_frames, help="comma list: one session per value")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=json_out)
    return p


def session_at(lm: VideoLM, video: str, max_frames: int, fps: float = 2.0) -> VisualSession:
    """The video sampled at `fps`, at most `max_frames` frames, encoded and prefilled once."""
    sampling = lm.default_sampling(fps=fps, max_frames=max_frames)
    return VisualSession.create(lm, lm.prepare_video(read_video(video, sampling), sampling), headroom=256)


def prompted_sessions(
    lm: VideoLM, video: str, max_frames: str, prompt: str = "describe the video ."
) -> Iterator[VisualSession]:
    """For each frame count of `max_frames` (a comma list): a session with `prompt`'s suffix extended, inside
    `session.prompt()` (undone when the caller moves on to the next one)."""
    for mf in frame_counts(max_frames):
        session = session_at(lm, video, mf)
        with session.prompt():
            session.extend(lm.suffix_ids(prompt))
            yield session


def frame_counts(arg: str) -> list[int]:
    return [int(x) for x in arg.split(",")]


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")


def model_and_head(a: argparse.Namespace) -> tuple[VideoLM, SparrowHead]:
    """The model of `--model` on CPU with `--threads` threads, and its shipped Sparrow head (required)."""
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device="cpu")
    head = draft_head(lm)
    assert head is not None, "needs the model's Sparrow head"
    return lm, head


def earlier_build(path: str, current: ctypes.CDLL, names: tuple[str, ...]) -> ctypes.CDLL:
    """Another build of the kernel library (an A/B arm), its entry points `names` declared as `current`'s."""
    lib = ctypes.CDLL(path)
    for name in names:
        getattr(lib, name).restype = getattr(current, name).restype
        getattr(lib, name).argtypes = getattr(current, name).argtypes
    return lib


def answers_tokens_per_s(
    session: VisualSession,
    prompts: list[list[int]],
    cfg: DecodeConfig,
    make: Callable[[], Proposer | None],
    ref: list[list[int]],
    what: str,
) -> float:
    """Every prompt answered with a fresh proposer from `make` (None: vanilla); each answer must equal `ref`'s
    (AssertionError naming `what` otherwise). Returns decode tokens per second over all of them."""
    outs = [run(session, q, cfg, make()) for q in prompts]
    if [o.tokens for o in outs] != ref:
        raise AssertionError(f"{what} differs from vanilla at {session.num_visual_tokens} visual tokens")
    return sum(len(o.tokens) for o in outs) / sum(o.stats.decode_s for o in outs)


def held_out_parser(doc: str, work_dir: str) -> argparse.ArgumentParser:
    """--model, --length, --videos, --work-dir, --threads, --json of a script over `vidspec eval`'s videos."""
    from decoders.train.eval import SETTINGS

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--length", default="short", choices=sorted(SETTINGS))
    p.add_argument("--videos", type=int, default=24, help="held-out videos of the length setting")
    p.add_argument("--work-dir", default=work_dir)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    return p


def held_out_sessions(
    lm: VideoLM, length: str, videos: int, work_dir: str
) -> Iterator[tuple[int, WorldSpec, VisualSession]]:
    """`(seed, world, session)` of `vidspec eval`'s first `videos` held-out videos of the length setting
    `length`, each sampled as eval samples it, encoded and prefilled once; progress printed after each."""
    from pathlib import Path

    from decoders.train.eval import SETTINGS, eval_video
    from decoders.train.reference import EVAL_SEED0

    setting = SETTINGS[length]
    for i in range(videos):
        seed = EVAL_SEED0 + setting.seed_offset + i
        world, path = eval_video(setting, seed, Path(work_dir))
        sampling = lm.default_sampling(fps=setting.fps, max_frames=setting.max_frames)
        yield seed, world, VisualSession.create(lm, lm.prepare_video(read_video(path, sampling), sampling))
        print(f"[{i + 1}/{videos}] seed {seed}", flush=True)


def count_by_qtype(
    rows: list[dict], counts: dict[str, Callable[[dict], object]]
) -> dict[str, dict[str, int]]:
    """Per question type (`row["qtype"]`) and over `all`: `n`, and for each `counts` name the number of rows
    for which its function is true."""
    by: dict[str, list[dict]] = {"all": []}
    for r in rows:
        by.setdefault(r["qtype"], []).append(r)
        by["all"].append(r)
    return {
        k: {"n": len(v), **{name: sum(bool(f(r)) for r in v) for name, f in counts.items()}}
        for k, v in sorted(by.items())
    }
