"""Where a training step of the reference model spends its time, per length bucket (no figure typed by hand).

Builds a ``Trainer`` with the shipped model's recipe (the flags in ``models/vidspec-reference``'s
``training_info.json``: aux head, count probe, attention supervision) from random weights, then runs the
steps ``--first`` .. ``--first + --steps - 1`` of that schedule (after the warm phase by default: the length
mix of most of a run) without prefetching, timing each part of every step on its own:

* ``data``: ``make_batch`` (rendering the worlds, the h264 round trip of some, patchifying), which a real run
  overlaps with the previous step on a background thread;
* ``forward``: ``batch_loss`` (vision tower, LM prefix and suffixes, every loss);
* ``backward``; ``update``: gradient clip, AdamW step and EMA update.

Also a ``torch.profiler`` table of the top operators by self CPU time over the timed steps (``--profile``).
``--compare-vision-attention``: instead, every step's batch runs forward + backward twice, with the stock
vision attention (one call per temporal group) and with ``use_batched_vision_attention`` (one call per
layer), alternating which goes first, no update; both losses are reported so that their equality is seen.
Reported per bucket: steps, visual tokens per step, seconds per part, visual tokens per second of
forward + backward + update. Usage:
    python benchmarks/train_profile.py --steps 24 --threads 2 --json benchmarks/results/train-profile.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from decoders.train import reference as R


def recipe(model_dir: Path) -> R.TrainConfig:
    """The shipped model's training config (the last stage's), as a ``TrainConfig``."""
    info = json.loads((model_dir / "training_info.json").read_text())
    return R._config_of({"config": {**info["config"], "init_from": None, "continue_schedule": False}})


def setup(args: argparse.Namespace) -> tuple[R.TrainConfig, int]:
    """Threads, the recipe planned to cover the timed steps, and the first of them."""
    torch.set_num_threads(args.threads)
    cfg = recipe(Path(args.model))
    first = cfg.warm_steps if args.first is None else args.first
    return replace(cfg, steps=max(cfg.steps, first + args.steps + 1)), first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference", help="whose training_info gives the recipe")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--first", type=int, default=None, help="first step (default: the end of the warm phase)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also a torch.profiler table of the top operators")
    p.add_argument("--compare-vision-attention", action="store_true", help="stock vs batched, side by side")
    p.add_argument("--json", default="benchmarks/results/train-profile.json")
    args = p.parse_args(argv)
    if args.compare_vision_attention:
        return compare_vision_attention(args)
    cfg, first = setup(args)
    parts = ("data", "forward", "backward", "update")
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    with tempfile.TemporaryDirectory() as tmp:
        tr = R.Trainer(cfg, Path(tmp))
        tr.prefetch = False
        tr.step = first
        prof = (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
        )
        if prof is not None:
            prof.__enter__()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            bucket, samples = R.make_batch(tr.lm, cfg, tr.step)
            t1 = time.perf_counter()
            out = R.batch_loss(tr.lm, tr.aux, samples, cfg)
            t2 = time.perf_counter()
            tr.opt.zero_grad(set_to_none=True)
            out.loss.backward()
            t3 = time.perf_counter()
            tr.update()
            t4 = time.perf_counter()
            row = per[bucket]
            row["steps"] += 1
            row["visual_tokens"] += out.visual_tokens
            spent = dict(zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True))
            for name, dt in spent.items():
                row[name] += dt
            print(
                f"step {tr.step} {bucket}: {out.visual_tokens} visual tokens, "
                + ", ".join(f"{n} {d:.2f}s" for n, d in spent.items()),
                flush=True,
            )
            tr.step += 1
        if prof is not None:
            prof.__exit__(None, None, None)
    rows = []
    total = defaultdict(float)
    for bucket, row in sorted(per.items()):
        for k, v in row.items():
            total[k] += v
        rows.append({"bucket": bucket, **row})
    rows.append({"bucket": "all", **total})
    for r in rows:
        n = r["steps"]
        train_s = r["forward"] + r["backward"] + r["update"]
        r["visual_tokens_per_step"] = r["visual_tokens"] / n
        r.update({f"{k}_s_per_step": r[k] / n for k in parts})
        r["train_vis_tok_per_s"] = r["visual_tokens"] / train_s
        r["share"] = {k: r[k] / (train_s + r["data"]) for k in parts}
    print(
        "| bucket | steps | vis tokens / step | data s | forward s | backward s | update s | vis tok/s (train) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['bucket']} | {r['steps']:.0f} | {r['visual_tokens_per_step']:.0f} | {r['data_s_per_step']:.2f} | "
            f"{r['forward_s_per_step']:.2f} | {r['backward_s_per_step']:.2f} | {r['update_s_per_step']:.3f} | "
            f"{r['train_vis_tok_per_s']:.0f} |"
        )
    doc: dict = {"model": args.model, "threads": args.threads, "first_step": first, "rows": rows}
    if prof is not None:
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
        all_self = sum(e.self_cpu_time_total for e in prof.key_averages())
        doc["top_ops"] = [
            {
                "op": e.key,
                "self_cpu_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / all_self,
                "calls": e.count,
            }
            for e in ops
        ]
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def compare_vision_attention(args: argparse.Namespace) -> int:
    """Forward + backward of the same batches with the stock and the batched vision attention."""
    cfg, first = setup(args)
    times: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        tr = R.Trainer(cfg, Path(tmp))  # patched: use_batched_vision_attention
        tr.prefetch = False
        attns = [b.attn for b in tr.lm.model.model.visual.blocks]
        batched = [a.__dict__["forward"] for a in attns]
        for i, step in enumerate(range(first, first + args.steps)):
            bucket, samples = R.make_batch(tr.lm, cfg, step)
            losses = {}
            for mode in ("stock", "batched") if i % 2 == 0 else ("batched", "stock"):
                for a, f in zip(attns, batched, strict=True):
                    if mode == "batched":
                        a.forward = f
                    else:
                        a.__dict__.pop("forward", None)
                tr.opt.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                out = R.batch_loss(tr.lm, tr.aux, samples, cfg)
                t1 = time.perf_counter()
                out.loss.backward()
                t2 = time.perf_counter()
                losses[mode] = float(out.loss.detach())
                for key in (bucket, "all"):
                    times[key][f"{mode}_s"] += t2 - t0
                    times[key][f"{mode}_forward_s"] += t1 - t0
                times[bucket]["steps"] += 0.5
                times["all"]["steps"] += 0.5
            rel = abs(losses["stock"] - losses["batched"]) / max(1e-9, abs(losses["stock"]))
            worst = max(worst, rel)
            print(
                f"step {step} {bucket}: {out.visual_tokens} visual tokens, loss {losses['stock']:.6f} / "
                f"{losses['batched']:.6f}, stock {times[bucket]['stock_s']:.1f}s batched "
                f"{times[bucket]['batched_s']:.1f}s so far",
                flush=True,
            )
    rows = [{"bucket": k, **v, "speedup": v["stock_s"] / v["batched_s"]} for k, v in sorted(times.items())]
    print("| bucket | steps | stock s / step | batched s / step | speedup (forward + backward) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        n = r["steps"]
        print(
            f"| {r['bucket']} | {n:.0f} | {r['stock_s'] / n:.2f} | {r['batched_s'] / n:.2f} | {r['speedup']:.2f}x |"
        )
    print(f"largest relative loss difference: {worst:.2e}")
    doc = {
        "model": args.model,
        "threads": args.threads,
        "first_step": first,
        "rows": rows,
        "max_rel_loss_diff": worst,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
