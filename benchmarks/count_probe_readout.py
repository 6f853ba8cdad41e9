"""Does the visual KV hold the counts that count questions ask for? (diagnostic, training-only heads)

Loads an export written with ``--export-aux`` (the model plus its training-only count probe), prefills fresh
training-distribution videos (short, 112 px, 2 fps, drawn by ``--seed``), and compares the probe's reading of
the decoder-layer-``count_layer`` states at the video's **last temporal group** (16 tokens) with the true
counts: in all, per colour (5 components) and per shape (4). The best constant per component group is printed
beside it. If the probe reads the counts there but the model answers ``count_colour`` with a constant, the
counts are in the KV and what fails is reading them out at the answer.

    python benchmarks/count_probe_readout.py --model runtime/v5-export --videos 40 --json OUT
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export with train_aux_head.safetensors beside it")
    ap.add_argument("--videos", type=int, default=40)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vision_probe import lm_visual_hidden  # benchmarks/ on sys.path (scripts run from there)

    from decoders.train import reference as R

    src = Path(args.model)
    if not (src / R.AUX_FILE).is_file():
        raise SystemExit(f"{src} has no {R.AUX_FILE}: export it with --export-aux")
    info = json.loads((src / "training_info.json").read_text())
    cfg = replace(R._config_of({"config": info["config"]}), init_from=str(src), continue_schedule=False)
    if cfg.count_weight <= 0:
        raise SystemExit(f"{src} was trained without the count probe")
    rng = np.random.default_rng(args.seed)
    groups = {"all": slice(0, 1), "colour": slice(1, 6), "shape": slice(6, 10)}
    hit: dict[str, list[float]] = {k: [] for k in groups}
    labels: dict[str, list[torch.Tensor]] = {k: [] for k in groups}
    with TemporaryDirectory() as tmp, torch.no_grad():
        tr = R.Trainer(cfg, Path(tmp))
        tr.lm.model.eval()
        lm = tr.lm
        for _ in range(args.videos):
            s = R.make_sample(lm, rng, int(rng.integers(40, 110)) * 2, 2.0, 112, codec=False)
            h = lm_visual_hidden(lm, s, [cfg.count_layer])[cfg.count_layer]  # [n_visual, hidden]
            per_group = s.num_tokens // s.grid_thw[0]
            last = slice(s.num_tokens - per_group, s.num_tokens)
            pred = tr.aux.count_logits(h).argmax(-1)[last]
            lab = s.counts[last]
            for k, sl in groups.items():
                hit[k].append(float((pred[:, sl] == lab[:, sl]).float().mean()))
                labels[k].append(lab[:, sl].reshape(-1))
    res = {"model": str(src), "videos": args.videos, "seed": args.seed, "count_layer": cfg.count_layer}
    for k in groups:
        lab = torch.cat(labels[k])
        best_const = float(torch.bincount(lab).max()) / len(lab)
        res[k] = {"probe_accuracy": round(float(np.mean(hit[k])), 4), "best_constant": round(best_const, 4)}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
