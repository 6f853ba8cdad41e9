"""Linear probes on a checkpoint's visual tokens: is colour / shape / motion direction in the features?

For held-out worlds (seeds from EVAL_SEED0 + 500_000 upwards, never trained on), short clips are rendered,
round-tripped through h264 and encoded by the model's vision tower; a linear classifier per attribute is
fitted on the visual tokens (merger outputs, RMS-normalised) of the first 70% of the videos that cover an
object and tested on the tokens of the rest. "majority" is the test accuracy of always answering the most
common training label. A probe near the majority baseline means the vision tower does not encode the
attribute, so no amount of language-model training can answer questions about it.

Usage: python benchmarks/vision_probe.py --model models/vidspec-reference [--videos 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from decoders.model import load_model
from decoders.train import reference as R

ATTRIBUTES = ("colour", "shape", "direction")
PROBE_SEED0 = R.EVAL_SEED0 + 500_000


def visual_tokens(lm: object, sample: R.Sample) -> torch.Tensor:
    grid = torch.tensor([sample.grid_thw])
    out = lm.model.model.get_video_features(sample.pixel_values, grid).pooler_output
    vis = torch.stack(list(out))[0]  # [n_visual, hidden]
    return F.rms_norm(vis, (vis.shape[-1],))


def fit_probe(x: torch.Tensor, y: torch.Tensor, classes: int, steps: int = 400) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(lin(x), y).backward()
        opt.step()
    return lin


def probe(model_dir: str, videos: int, frames: int) -> dict:
    lm = load_model(model_dir, device="cpu")
    feats, labels = [], []
    with torch.no_grad():
        for i in range(videos):
            rng = np.random.default_rng(PROBE_SEED0 + i)
            s = R.make_sample(lm, rng, frames, 2.0, R.FRAME_SIDE, codec=True)
            feats.append(visual_tokens(lm, s))
            labels.append(s.aux)
    split = int(0.7 * videos)
    out = {"model": model_dir, "videos": videos, "frames_per_video": frames, "attributes": {}}
    for col, name in enumerate(ATTRIBUTES):
        tr = [
            (f[lab[:, col] > 0], lab[lab[:, col] > 0, col] - 1)
            for f, lab in zip(feats[:split], labels[:split])
        ]
        te = [
            (f[lab[:, col] > 0], lab[lab[:, col] > 0, col] - 1)
            for f, lab in zip(feats[split:], labels[split:])
        ]
        xtr, ytr = torch.cat([a for a, _ in tr]), torch.cat([b for _, b in tr])
        xte, yte = torch.cat([a for a, _ in te]), torch.cat([b for _, b in te])
        classes = int(max(ytr.max(), yte.max())) + 1
        lin = fit_probe(xtr, ytr, classes)
        with torch.no_grad():
            acc = float((lin(xte).argmax(-1) == yte).float().mean())
        majority = float((yte == torch.bincount(ytr, minlength=classes).argmax()).float().mean())
        out["attributes"][name] = {
            "probe_accuracy": round(acc, 3),
            "majority": round(majority, 3),
            "train_tokens": len(ytr),
            "test_tokens": len(yte),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, help="checkpoint dir (repeatable)")
    p.add_argument("--videos", type=int, default=48)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for m in args.model:
        r = probe(m, args.videos, args.frames)
        results.append(r)
        for name, a in r["attributes"].items():
            print(
                f"{m}: {name:9s} probe {a['probe_accuracy']:.3f}  majority {a['majority']:.3f}",
                file=sys.stderr,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
