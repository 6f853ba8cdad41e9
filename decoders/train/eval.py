"""``vidspec eval``: answer quality on held-out world videos, for any decoding method.

Contract
--------
* ``evaluate(model_dir, method="vanilla", lengths=("short", "long"), ...) -> dict``. Videos are worlds with
  seeds from ``seed0`` upwards (default ``EVAL_SEED0``: never used in training), written to real mp4 files
  under ``work_dir`` (reused when present), read back with ``read_video`` at the model's default frame size
  (``lm.default_sampling``) and the length setting's fps, prefilled once into a ``VisualSession`` and
  answered with ``engine.run`` (greedy). ``method="vanilla"`` decodes without a proposer; any other method
  needs ``proposer_factory(lm, session) -> Proposer`` (called once per prompt), so lossy and lossless
  drafters are scored on the same videos and questions.
* Every question ``world.questions`` asks about a video is scored by exact match of the answer with the
  whitespace-normalised reply's final answer (``world.final_answer``: what follows its last `` . ``; a model
  trained with ``--qa-trace`` lists the video's objects first, then answers; a reply without `` . `` is
  scored whole); ``records`` keep both the ``reply`` and the ``prediction``. One caption per video (prompt
  ``"describe the video ."``, asked after the model's own object list when it was trained so:
  ``--caption-turns``, ``decoders.protocol.captions_after_list``) is scored by the ordered ``(colour, shape)``
  events ``world.caption_events`` recovers from it, matched to the event log by longest common subsequence: precision = matched /
  predicted, recall = matched / true (summed over videos), F1.
* Length settings (``SETTINGS``): ``short`` (10-110 s at 2 fps: 20-220 frames, under 2k visual tokens at
  112x112) and ``long`` (3600 s at 0.6 fps: 2160 frames, 17280 visual tokens); ``tiny`` is for tests.
* The result holds, per length: ``n_videos``, ``visual_tokens`` (min/mean/max), ``frames``, ``qa``
  (``accuracy``, ``n``, ``per_qtype`` with ``accuracy``, ``n``, ``chance_uniform`` = 1 / distinct answers of
  that type in this eval set, ``chance_majority`` = the best constant answer's accuracy), ``chance`` (overall
  majority-answer accuracy), ``caption`` (``precision``, ``recall``, ``f1``, ``exact``, ``n``), ``seconds``;
  ``qa_protocol`` and ``caption_protocol`` (``"direct"`` or ``"after_list"``); plus ``records`` (every
  question, answer and prediction) when asked.
* ``merge_results(parts)``: the results of invocations over disjoint length settings (same model, method and
  ``seed0``), e.g. ``short`` and ``long`` run side by side on one thread each, as one result
  (``vidspec eval --merge A.json B.json --json OUT``); a note records the merge.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from decoders.protocol import after_list, ask_object_list, captions_after_list, trained_with_turns
from decoders.train import world as W
from decoders.train.reference import EVAL_SEED0

__all__ = ["SETTINGS", "LengthSetting", "evaluate", "lcs_len", "main"]

CAPTION_PROMPT = "describe the video ."


@dataclass(frozen=True)
class LengthSetting:
    name: str
    duration_s: tuple[float, float]  # uniform range
    fps: float  # world fps = sampling fps (every frame of the file is sampled)
    max_frames: int
    seed_offset: int  # seeds of this setting: seed0 + seed_offset + i
    side: int = 112  # frame side of the written mp4


SETTINGS: dict[str, LengthSetting] = {
    "tiny": LengthSetting("tiny", (4.0, 8.0), 2.0, 64, 900_000),
    "short": LengthSetting("short", (10.0, 110.0), 2.0, 768, 0),
    "long": LengthSetting("long", (3600.0, 3600.0), 0.6, 4096, 100_000),
}


def lcs_len(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common subsequence of two sequences."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _norm(text: str) -> str:
    return " ".join(text.strip().split())


def eval_world(setting: LengthSetting, seed: int) -> W.WorldSpec:
    rng = np.random.default_rng([seed, 7])
    lo, hi = setting.duration_s
    duration = float(rng.uniform(lo, hi)) if hi > lo else lo
    return W.make_world(seed, round(duration, 2), setting.fps, setting.side, setting.side)


def eval_questions(world: W.WorldSpec, seed: int) -> list[W.QA]:
    """The questions ``vidspec eval`` asks about the held-out world of ``seed`` (drawn by seed, so every
    benchmark that rebuilds the world asks the same ones)."""
    return W.questions(world, np.random.default_rng([seed, 11]))


def eval_video(setting: LengthSetting, seed: int, work_dir: Path) -> tuple[W.WorldSpec, Path]:
    """The world of ``seed`` and its mp4 (written once, reused while its event log matches)."""
    world = eval_world(setting, seed)
    return world, world_video(world, work_dir / "videos" / f"{setting.name}-{seed}.mp4")


def world_video(world: W.WorldSpec, path: Path) -> Path:
    """``path``, the mp4 of ``world``: written unless it is there with the same event log beside it."""
    meta = path.with_suffix(".json")
    if not (path.exists() and meta.exists() and json.loads(meta.read_text()) == W.world_to_json(world)):
        W.write_world_video(world, path)
    return path


ProposerFactory = Callable[[object, object], object]


def evaluate(
    model_dir: str | os.PathLike,
    method: str = "vanilla",
    lengths: Sequence[str] = ("short", "long"),
    n_videos: int | dict[str, int] | None = None,
    seed0: int = EVAL_SEED0,
    work_dir: str | os.PathLike = "runtime/eval",
    proposer_factory: ProposerFactory | None = None,
    max_new_tokens: int = 160,
    keep_records: bool = True,
    lm: object | None = None,
    log: Callable[[str], None] | None = print,
    qa_turns: bool | None = None,
    caption_turns: bool | None = None,
) -> dict:
    """Score ``model_dir`` on held-out videos; see the module docstring for the result's keys.

    ``qa_turns``: ask each question after the model's own object list (two-turn QA, ``reference.after_list``:
    the list is generated once per video); None: as the model was trained (``trained_with_turns``).
    ``caption_turns``: ask for the caption after that list too; None: as the model was trained
    (``captions_after_list``)."""
    from decoders.engine import run
    from decoders.model import load_model
    from decoders.sampling import DecodeConfig
    from decoders.session import VisualSession
    from decoders.video import read_video

    if method != "vanilla" and proposer_factory is None:
        raise ValueError(f"method {method!r} needs a proposer_factory (only 'vanilla' is built in)")
    defaults = {"tiny": 2, "short": 30, "long": 6}
    counts = {
        name: (
            n_videos.get(name, defaults.get(name, 4))
            if isinstance(n_videos, dict)
            else n_videos or defaults[name]
        )
        for name in lengths
    }
    unknown = [n for n in lengths if n not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown length setting(s) {unknown}; known: {sorted(SETTINGS)}")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if lm is None:
        lm = load_model(model_dir, device="cpu")
    say = log or (lambda _msg: None)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    if qa_turns is None:
        qa_turns = trained_with_turns(model_dir)
    if caption_turns is None:
        caption_turns = captions_after_list(model_dir)
    result: dict = {"model": str(model_dir), "method": method, "seed0": seed0, "lengths": {}}
    result["qa_protocol"] = "after_list" if qa_turns else "direct"
    result["caption_protocol"] = "after_list" if caption_turns else "direct"
    records: list[dict] = []
    for name in lengths:
        setting = SETTINGS[name]
        t_len = time.perf_counter()
        tokens: list[int] = []
        frames: list[int] = []
        qa_rows: list[dict] = []
        cap_pred = cap_true = cap_match = cap_exact = 0
        for i in range(counts[name]):
            seed = seed0 + setting.seed_offset + i
            t0 = time.perf_counter()
            world, path = eval_video(setting, seed, work)
            sampling = lm.default_sampling(fps=setting.fps, max_frames=setting.max_frames)
            video = read_video(path, sampling)
            visual = lm.prepare_video(video, sampling)
            session = VisualSession.create(lm, visual)
            tokens.append(visual.num_tokens)
            frames.append(video.num_frames)
            correct = 0
            qas = eval_questions(world, seed)
            listed = None
            if qa_turns or caption_turns:  # the first turn: the model's own object list, once per video
                prop = proposer_factory(lm, session) if proposer_factory is not None else None
                listed = ask_object_list(lm, session, max_new_tokens, prop)
            for qa in qas:
                prop = proposer_factory(lm, session) if proposer_factory is not None else None
                asked = qa.question if not qa_turns else after_list(listed, qa.question)
                out = run(session, lm.suffix_ids(asked), cfg, prop)
                reply = _norm(out.text)
                pred = W.final_answer(reply)  # a traced reply lists the objects first (world.answer_text)
                ok = pred == qa.answer
                correct += ok
                row = {
                    "length": name,
                    "seed": seed,
                    "qtype": qa.qtype,
                    "question": qa.question,
                    "answer": qa.answer,
                    "prediction": pred,
                    "reply": reply,
                    "correct": ok,
                    "trace_right": trace_right(world, qa, reply),
                }
                if qa_turns:
                    row["object_list"] = listed
                    row["list_right"] = listed == W.object_list(world)
                qa_rows.append(row)
                if keep_records:
                    records.append(row)
            prop = proposer_factory(lm, session) if proposer_factory is not None else None
            cap_asked = CAPTION_PROMPT if not caption_turns else after_list(listed, CAPTION_PROMPT)
            out = run(session, lm.suffix_ids(cap_asked), cfg, prop)
            pred_ev = W.caption_events(out.text)
            true_ev = W.event_pairs(world)
            m = lcs_len(pred_ev, true_ev)
            cap_pred += len(pred_ev)
            cap_true += len(true_ev)
            cap_match += m
            cap_exact += pred_ev == true_ev
            if keep_records:
                records.append(
                    {
                        "length": name,
                        "seed": seed,
                        "qtype": "caption",
                        "question": CAPTION_PROMPT,
                        "answer": W.caption(world),
                        "prediction": _norm(out.text),
                        "events_true": [" ".join(e) for e in true_ev],
                        "events_pred": [" ".join(e) for e in pred_ev],
                        "matched": m,
                        **({"object_list": listed} if caption_turns else {}),
                    }
                )
            say(
                f"[eval {name} {i + 1}/{counts[name]}] seed {seed}: {video.num_frames} frames, "
                f"{visual.num_tokens} visual tokens, QA {correct}/{len(qas)}, caption events {m}/{len(true_ev)} "
                f"(pred {len(pred_ev)}) [{time.perf_counter() - t0:.1f}s]"
            )
            del session
        result["lengths"][name] = _summarise(qa_rows, cap_pred, cap_true, cap_match, cap_exact, counts[name])
        result["lengths"][name].update(
            visual_tokens={"min": min(tokens), "mean": float(np.mean(tokens)), "max": max(tokens)},
            frames={"min": min(frames), "mean": float(np.mean(frames)), "max": max(frames)},
            fps=setting.fps,
            seconds=round(time.perf_counter() - t_len, 1),
        )
        r = result["lengths"][name]
        say(
            f"[eval {name}] QA {r['qa']['accuracy']:.3f} (chance {r['chance']:.3f}), caption F1 "
            f"{r['caption']['f1']:.3f}, {r['visual_tokens']['mean']:.0f} visual tokens on average"
            + _traced_words(r["qa"]["traced"])
        )
    if keep_records:
        result["records"] = records
    return result


def trace_right(world: W.WorldSpec, qa: W.QA, reply: str) -> bool | None:
    """Whether a traced reply's trace (what precedes its last `` . ``) is the one the world gives for ``qa``
    in any style (``world.object_list``, ``world.scan_list`` or ``world.cued_scan``), or the cue a cued two-turn
    reply repeats (``world.cued_answer``); None for an untraced question type or a reply without a trace."""
    if qa.qtype not in W.TRACED_QTYPES:
        return None
    trace, sep, _ = _norm(reply).rpartition(" . ")
    if not sep:
        return None
    if trace in (W.object_list(world), W.scan_list(world, qa)):
        return True
    return bool(qa.cue) and trace in (qa.cue, W.cued_scan(world, qa))


def _traced_summary(rows: list[dict]) -> dict:
    """Over the traced question types: replies with a trace, right traces, and right answers after one."""
    traced = [r for r in rows if r["qtype"] in W.TRACED_QTYPES]
    with_trace = [r for r in traced if r.get("trace_right") is not None]
    right = [r for r in with_trace if r["trace_right"]]
    return {
        "n": len(traced),
        "with_trace": len(with_trace),
        "trace_right": len(right),
        "answer_right_after_right_trace": sum(r["correct"] for r in right),
    }


def _traced_words(t: dict) -> str:
    if not t["with_trace"]:
        return ""
    return (
        f"; traced replies: {t['trace_right']}/{t['n']} traces right, "
        f"{t['answer_right_after_right_trace']} of those answered right"
    )


def _summarise(rows: list[dict], pred: int, true: int, match: int, exact: int, n_videos: int) -> dict:
    per: dict[str, dict] = {}
    chance_hits = 0.0
    for qt in W.QTYPES:
        rs = [r for r in rows if r["qtype"] == qt]
        if not rs:
            continue
        answers = Counter(r["answer"] for r in rs)
        majority = answers.most_common(1)[0][1] / len(rs)
        chance_hits += majority * len(rs)
        per[qt] = {
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "n": len(rs),
            "chance_uniform": 1 / len(answers),
            "chance_majority": majority,
        }
    precision = match / pred if pred else 0.0
    recall = match / true if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    n = len(rows)
    return {
        "n_videos": n_videos,
        "qa": {
            "accuracy": sum(r["correct"] for r in rows) / n if n else 0.0,
            "n": n,
            "per_qtype": per,
            # how a traced answer goes wrong: in the trace (the objects), or in reading the answer from it
            "traced": _traced_summary(rows),
        },
        "chance": chance_hits / n if n else 0.0,
        "caption": {
            "precision": precision,
            "recall": recall,
            "f1": f1,
            "exact": exact / max(1, n_videos),
            "n": n_videos,
        },
    }


def merge_results(parts: Sequence[dict]) -> dict:
    """One result from invocations over disjoint length settings of one model, method and ``seed0``."""
    if len(parts) < 2:
        raise ValueError("merge needs at least two results")
    keys = ("model", "method", "seed0", "qa_protocol", "caption_protocol")
    first = parts[0]
    for part in parts[1:]:
        diff = {k: (first.get(k), part.get(k)) for k in keys if first.get(k) != part.get(k)}
        if diff:
            raise ValueError(f"cannot merge results of different runs: {diff}")
    merged: dict = {k: first[k] for k in keys if k in first}  # results before a protocol key have none
    merged["lengths"] = {}
    records: list[dict] = []
    for part in parts:
        overlap = set(merged["lengths"]) & set(part["lengths"])
        if overlap:
            raise ValueError(f"length setting(s) {sorted(overlap)} appear in more than one result")
        merged["lengths"].update(part["lengths"])
        records += part.get("records", [])
    if all("records" in part for part in parts):
        merged["records"] = records
    merged["note"] = "merged from {} invocations of one command over the length settings {}".format(
        len(parts), " + ".join(",".join(part["lengths"]) for part in parts)
    )
    return merged


def _weights_digest(model: str) -> str | None:
    """sha256 of a checkpoint's ``model.safetensors``; None where it is not on disk."""
    import hashlib

    path = Path(model) / "model.safetensors"
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pooled_spread(summaries: Sequence[dict], key: str) -> dict:
    """Min, video-weighted mean and max of a per-length ``{"min", "mean", "max"}`` figure over blocks."""
    return {
        "min": min(r[key]["min"] for r in summaries),
        "mean": sum(r[key]["mean"] * r["n_videos"] for r in summaries)
        / sum(r["n_videos"] for r in summaries),
        "max": max(r[key]["max"] for r in summaries),
    }


def pool_results(parts: Sequence[dict]) -> dict:
    """One result over several blocks of held-out videos (results of different ``seed0``): the figures are
    recomputed from the per-question and per-caption records of every block, as if one invocation had asked
    them all. The blocks must be of one model (the same path, or checkpoints whose weights are the same bytes),
    method and protocol, must keep their records, and must not share a video."""
    if len(parts) < 2:
        raise ValueError("pooling needs at least two results")
    keys = ("method", "qa_protocol", "caption_protocol")
    first = parts[0]
    for part in parts:
        if "records" not in part:
            raise ValueError(
                f"a result of seed0 {part.get('seed0')} has no records (--no-records): cannot pool"
            )
        diff = {k: (first.get(k), part.get(k)) for k in keys if first.get(k) != part.get(k)}
        if diff:
            raise ValueError(f"cannot pool results of different methods or protocols: {diff}")
    models = sorted({part["model"] for part in parts})
    if len(models) > 1:
        digests = {m: _weights_digest(m) for m in models}
        if None in digests.values() or len(set(digests.values())) > 1:
            raise ValueError(
                f"cannot pool results of different models (or models not on disk to compare): {models}"
            )
    seen: set[tuple[str, int]] = set()
    for part in parts:
        videos = {(r["length"], r["seed"]) for r in part["records"]}
        if videos & seen:
            raise ValueError(f"video(s) {sorted(videos & seen)[:3]} appear in more than one result")
        seen |= videos
    pooled: dict = {"model": first["model"], **{k: first[k] for k in keys if k in first}}
    if len(models) > 1:
        pooled["models"] = models  # the same weights under several paths
    pooled["blocks"] = [
        {"seed0": part["seed0"], "n_videos": {n: r["n_videos"] for n, r in part["lengths"].items()}}
        for part in parts
    ]
    pooled["lengths"] = {}
    records = [r for part in parts for r in part["records"]]
    names = list(dict.fromkeys(n for part in parts for n in part["lengths"]))
    for name in names:
        summaries = [part["lengths"][name] for part in parts if name in part["lengths"]]
        fps = {r["fps"] for r in summaries}
        if len(fps) > 1:
            raise ValueError(f"length setting {name!r} was read at different rates {sorted(fps)}")
        rows = [r for r in records if r["length"] == name and r["qtype"] != "caption"]
        caps = [r for r in records if r["length"] == name and r["qtype"] == "caption"]
        n_videos = sum(r["n_videos"] for r in summaries)
        if len(caps) != n_videos:
            raise ValueError(f"{name}: {len(caps)} caption records for {n_videos} videos")
        summary = _summarise(
            rows,
            sum(len(c["events_pred"]) for c in caps),
            sum(len(c["events_true"]) for c in caps),
            sum(c["matched"] for c in caps),
            sum(c["events_pred"] == c["events_true"] for c in caps),
            n_videos,
        )
        summary.update(
            visual_tokens=_pooled_spread(summaries, "visual_tokens"),
            frames=_pooled_spread(summaries, "frames"),
            fps=fps.pop(),
            seconds=round(sum(r["seconds"] for r in summaries), 1),
        )
        pooled["lengths"][name] = summary
    pooled["records"] = records
    pooled["note"] = "pooled from {} blocks of held-out videos: {}".format(
        len(parts),
        "; ".join(
            f"seed0 {b['seed0']}: " + ", ".join(f"{n} {k}" for n, k in b["n_videos"].items())
            for b in pooled["blocks"]
        ),
    )
    return pooled


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vidspec eval", description="QA accuracy and caption F1 on held-out videos."
    )
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--method", default="vanilla", help="vanilla, std, sparrow, auto or lvspec")
    p.add_argument("--lam", type=float, default=0.5, help="lvspec relaxation ratio")
    p.add_argument("--shift-window", type=int, default=0, help="lvspec position-shift window")
    p.add_argument("--lvspec-base", default="std", choices=["std", "sparrow"])
    p.add_argument("--lengths", default="short,long", help="comma-separated: " + ",".join(SETTINGS))
    p.add_argument("--n-short", type=int, default=30)
    p.add_argument("--n-long", type=int, default=6)
    p.add_argument("--n-tiny", type=int, default=2)
    p.add_argument("--seed0", type=int, default=EVAL_SEED0)
    p.add_argument("--work-dir", default="runtime/eval")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the JSON result here")
    p.add_argument(
        "--qa-turns",
        default="auto",
        choices=["auto", "on", "off"],
        help="ask questions after the model's own object list (two-turn QA); auto: as the model was trained",
    )
    p.add_argument(
        "--caption-turns",
        default="auto",
        choices=["auto", "on", "off"],
        help="ask for the caption after the model's own object list too; auto: as the model was trained",
    )
    p.add_argument("--no-records", action="store_true", help="leave per-question records out of the JSON")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="merge the results of invocations over disjoint --lengths (same model, method, seed0) and exit",
    )
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        help="pool the results of several blocks of held-out videos (different --seed0; same model, method and "
        "protocol; records kept) into one, recomputed from their records, and exit",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, combine in (("merge", merge_results), ("pool", pool_results)):
        files = getattr(args, flag)
        if files:
            try:
                res = combine([json.loads(Path(f).read_text()) for f in files])
            except (OSError, ValueError, KeyError) as e:
                raise SystemExit(f"--{flag}: {e}") from None
            return _report(res, args.json)
    torch.set_num_threads(max(1, args.threads))
    lengths = [s for s in args.lengths.split(",") if s]
    factory = None
    if args.method != "vanilla":
        from decoders.proposers import router

        opts = router.LVSpecSettings(base=args.lvspec_base, lam=args.lam, shift_window=args.shift_window)

        def factory(lm: object, session: object) -> object:
            return router.make_proposer(args.method, session, lvspec=opts)

    res = evaluate(
        args.model,
        method=args.method,
        proposer_factory=factory,
        lengths=lengths,
        n_videos={"short": args.n_short, "long": args.n_long, "tiny": args.n_tiny},
        seed0=args.seed0,
        work_dir=args.work_dir,
        max_new_tokens=args.max_new_tokens,
        keep_records=not args.no_records,
        qa_turns={"auto": None, "on": True, "off": False}[args.qa_turns],
        caption_turns={"auto": None, "on": True, "off": False}[args.caption_turns],
    )
    return _report(res, args.json)


def _report(res: dict, json_path: str | None) -> int:
    summary = {k: v for k, v in res.items() if k != "records"}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
