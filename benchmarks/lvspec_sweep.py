"""LVSpec quality and speed sweep: lambda x shift window, at the eval's short and long lengths.

For each held-out eval video (the same worlds `vidspec eval` uses), one session is prefilled once and every
setting answers all of its questions and one caption on it: vanilla (the reference), the lossless drafter
under LVSpec (its speed baseline), and LVSpec for every (lambda, window). Reported per length and setting:
QA exact-match accuracy, caption event F1, their retention relative to vanilla, mean accepted length, and
decode speedup over vanilla and over the lossless drafter (decode seconds summed over all prompts).
With --repeats N every setting answers every prompt N times, the settings interleaved repeat by repeat (drift
on a shared machine hits them alike); a setting's time on a video is the median over repeats of its summed
decode time there, and quality is pooled over repeats (adaptive draft lengths can change a lossy answer).
Usage: python benchmarks/lvspec_sweep.py --model models/vidspec-reference --short 8 --long 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from decoders.engine import run
from decoders.model import load_model
from decoders.proposers import router
from decoders.proposers.router import LVSpecSettings
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train import world as W
from decoders.train.eval import CAPTION_PROMPT, SETTINGS, eval_questions, eval_video, lcs_len
from decoders.train.reference import EVAL_SEED0
from decoders.video import read_video
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status


def _score(rows: list[dict]) -> dict:
    qa = [r for r in rows if r["kind"] == "qa"]
    cap = [r for r in rows if r["kind"] == "caption"]
    pred, true, match = (sum(r[k] for r in cap) for k in ("pred", "true", "match"))
    p = match / pred if pred else 0.0
    rc = match / true if true else 0.0
    drafts = sum(r["drafts"] for r in rows)
    per_run: dict[tuple[int, int], float] = {}  # (video, repeat) -> summed decode seconds
    for r in rows:
        key = (r.get("video", 0), r.get("repeat", 0))
        per_run[key] = per_run.get(key, 0.0) + r["decode_s"]
    videos = sorted({v for v, _ in per_run})
    decode_s = sum(statistics.median(t for (v, _), t in per_run.items() if v == video) for video in videos)
    return {
        "qa_accuracy": sum(r["correct"] for r in qa) / max(1, len(qa)),
        "caption_f1": 2 * p * rc / (p + rc) if p + rc else 0.0,
        "mean_accepted_length": (1 + sum(r["accepted"] for r in rows) / drafts) if drafts else None,
        "decode_s": decode_s,
        "n_qa": len(qa),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/vidspec-reference")
    ap.add_argument("--base", default="std", choices=["std", "sparrow"])
    ap.add_argument("--lams", default="0,0.3,0.5,0.7,0.9")
    ap.add_argument("--windows", default="0,1")
    ap.add_argument("--relevance-threshold", type=float, default=0.3)
    ap.add_argument("--short", type=int, default=8, help="short eval videos")
    ap.add_argument("--long", type=int, default=2, help="long eval videos (16k+ visual tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats per video (median time)")
    ap.add_argument("--json", default="benchmarks/results/lvspec-sweep.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    settings = [("vanilla", None), (a.base, None)]
    settings += [
        (
            f"lvspec lam={lam:g} w={w}",
            LVSpecSettings(base=a.base, lam=lam, shift_window=w, relevance_threshold=a.relevance_threshold),
        )
        for lam in (float(x) for x in a.lams.split(","))
        for w in (int(x) for x in a.windows.split(","))
    ]
    work = Path("runtime/eval")
    results: dict = {}
    for length, count in (("short", a.short), ("long", a.long)):
        if count <= 0:
            continue
        setting = SETTINGS[length]
        rows: dict[str, list[dict]] = {name: [] for name, _ in settings}
        tokens = []
        for i in range(count):
            seed = EVAL_SEED0 + setting.seed_offset + i
            world, path = eval_video(setting, seed, work)
            sampling = lm.default_sampling(fps=setting.fps, max_frames=setting.max_frames)
            session = VisualSession.create(lm, lm.prepare_video(read_video(path, sampling), sampling))
            tokens.append(session.num_visual_tokens)
            qas = eval_questions(world, seed)
            prompts = [("qa", qa.question, qa.answer) for qa in qas] + [("caption", CAPTION_PROMPT, None)]
            t0 = time.perf_counter()
            for rep, (name, opts) in ((r, st) for r in range(a.repeats) for st in settings):
                for kind, text, answer in prompts:
                    if name == "vanilla":
                        prop = None
                    elif opts is None:
                        prop = router.make_proposer(name, session)
                    else:
                        prop = router.make_proposer("lvspec", session, lvspec=opts)
                    out = run(session, lm.suffix_ids(text), cfg, prop)
                    pred = " ".join(out.text.split())
                    row = {
                        "video": i,
                        "repeat": rep,
                        "kind": kind,
                        "decode_s": out.stats.decode_s,
                        "drafts": out.stats.num_drafts,
                        "accepted": out.stats.num_accepted_tokens,
                        "correct": pred == answer,
                    }
                    if kind == "caption":
                        pe, te = W.caption_events(out.text), W.event_pairs(world)
                        row.update(pred=len(pe), true=len(te), match=lcs_len(pe, te))
                    rows[name].append(row)
            print(
                f"[{length} {i + 1}/{count}] {session.num_visual_tokens} visual tokens, {time.perf_counter() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )
        ref = _score(rows["vanilla"])
        base = _score(rows[a.base])
        table = []
        for name, _ in settings:
            s = _score(rows[name])
            s.update(
                setting=name,
                qa_retention=s["qa_accuracy"] / ref["qa_accuracy"] if ref["qa_accuracy"] else None,
                caption_retention=s["caption_f1"] / ref["caption_f1"] if ref["caption_f1"] else None,
                speedup_vs_vanilla=ref["decode_s"] / s["decode_s"] if s["decode_s"] else None,
                speedup_vs_lossless=base["decode_s"] / s["decode_s"] if s["decode_s"] else None,
            )
            table.append(s)
        results[length] = {"visual_tokens": tokens, "rows": table}

    def f(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    print(
        "| length | setting | QA acc | caption F1 | QA retention | caption retention | mean accepted length | speedup vs vanilla | vs lossless drafter |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for length, res in results.items():
        for r in res["rows"]:
            print(
                f"| {length} ({int(np.mean(res['visual_tokens']))} tok) | {r['setting']} | {f(r['qa_accuracy'])} | {f(r['caption_f1'])} "
                f"| {f(r['qa_retention'])} | {f(r['caption_retention'])} | {f(r['mean_accepted_length'])} "
                f"| {f(r['speedup_vs_vanilla'])}x | {f(r['speedup_vs_lossless'])}x |"
            )
    doc = {"model": a.model, "base": a.base, "repeats": a.repeats, "blas": cpu_status(), "results": results}
    Path(a.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
