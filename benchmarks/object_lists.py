"""How far into a video's object list does a reference model stay right, by number of objects and length?

A diagnostic for issue 3's one-hour QA: every traced answer and every caption lists the video's objects in
order, so a model whose lists break after the k-th object cannot answer about the later ones. For each
number of objects (``--objects``) and each length (``short``: 100 s at 2 fps, 1,600 visual tokens;
``hour``: 3600 s at 0.6 fps, 17,280 visual tokens; both 112x112), ``--seeds`` held-out worlds (seeds from
``EVAL_SEED0 + 500_000``, never used in training) are captioned greedily (``describe the video .``) and
the caption's ``(colour, shape)`` events are compared with the event log:

* ``prefix``: how many leading events are right before the first wrong or missing one;
* ``recall``: the longest common subsequence over the true count (as ``vidspec eval``'s caption recall).

    python benchmarks/object_lists.py --model models/vidspec-reference --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

LENGTHS = {"short": (100.0, 2.0), "hour": (3600.0, 0.6)}  # duration (s), fps


def leading_right(pred: list, true: list) -> int:
    """Number of leading items of ``pred`` equal to ``true``'s."""
    n = 0
    for a, b in zip(pred, true, strict=False):
        if a != b:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--objects", default="2,4,6,8", help="comma-separated object counts")
    p.add_argument("--lengths", default="short,hour", help=f"comma-separated: {','.join(LENGTHS)}")
    p.add_argument("--seeds", type=int, default=3, help="worlds per (objects, length)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work-dir", default="runtime/object-lists")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    import torch

    torch.set_num_threads(args.threads)
    from decoders.engine import run
    from decoders.model import load_model
    from decoders.sampling import DecodeConfig
    from decoders.session import VisualSession
    from decoders.train import world as W
    from decoders.train.eval import CAPTION_PROMPT, lcs_len, world_video
    from decoders.train.reference import EVAL_SEED0
    from decoders.video import read_video

    lm = load_model(args.model, device="cpu")
    cfg = DecodeConfig(max_new_tokens=160)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows, summary = [], {}
    for li, length in enumerate(args.lengths.split(",")):
        duration, fps = LENGTHS[length]
        for n in (int(x) for x in args.objects.split(",")):
            got = []
            for k in range(args.seeds):
                seed = EVAL_SEED0 + 500_000 + 10_000 * li + 100 * n + k
                world = W.make_world(seed, duration, fps, 112, 112, n_events=n)
                path = world_video(world, work / f"{length}-{seed}.mp4")
                sampling = lm.default_sampling(fps=fps, max_frames=4096)
                visual = lm.prepare_video(read_video(path, sampling), sampling)
                t0 = time.perf_counter()
                session = VisualSession.create(lm, visual)
                text = run(session, lm.suffix_ids(CAPTION_PROMPT), cfg, None).text
                pred, true = W.caption_events(text), W.event_pairs(world)
                row = {
                    "length": length,
                    "objects": n,
                    "seed": seed,
                    "visual_tokens": visual.num_tokens,
                    "prefix": leading_right(pred, true),
                    "lcs": lcs_len(pred, true),
                    "predicted": len(pred),
                    "events_true": [" ".join(e) for e in true],
                    "events_pred": [" ".join(e) for e in pred],
                }
                rows.append(row)
                got.append(row)
                print(
                    f"[{length} {n} objects {k + 1}/{args.seeds}] {visual.num_tokens} visual tokens: "
                    f"{row['prefix']} leading right, {row['lcs']}/{n} in order "
                    f"({len(pred)} listed) [{time.perf_counter() - t0:.1f}s]",
                    flush=True,
                )
                del session
            summary[f"{length}/{n}"] = {
                "prefix_mean": float(np.mean([r["prefix"] for r in got])),
                "recall": sum(r["lcs"] for r in got) / (n * len(got)),
                "all_right": sum(r["prefix"] == n and r["predicted"] == n for r in got),
                "n": len(got),
            }
    for key, s in summary.items():
        print(
            f"{key:10s} leading right {s['prefix_mean']:.1f}, recall {s['recall']:.2f}, "
            f"whole list right {s['all_right']}/{s['n']}"
        )
    if args.json:
        out = {"model": args.model, "seeds_per_cell": args.seeds, "summary": summary, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
