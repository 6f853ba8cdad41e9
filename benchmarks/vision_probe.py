"""Linear probes on a checkpoint's visual tokens: is colour / shape / motion direction in the features?

For held-out worlds (seeds from EVAL_SEED0 + 500_000 upwards, never trained on), short clips are rendered,
round-tripped through h264 and encoded by the model's vision tower; a linear classifier per attribute is
fitted on the visual tokens (merger outputs, RMS-normalised) of the first 70% of the videos that cover an
object and tested on the tokens of the rest. "majority" is the test accuracy of always answering the most
common training label. A probe near the majority baseline means the vision tower does not encode the
attribute, so no amount of language-model training can answer questions about it.
With `--lm-layers 2,4,6,8` the same probes also run on the language model's hidden states at the visual
positions after those decoder layers (the video prefilled as at inference: system turn, then the video;
0 = the merger output as the LM receives it): whether an attribute the vision tower encodes survives into the
visual KV the answers read.

Usage: python benchmarks/vision_probe.py --model models/vidspec-reference [--videos 48] [--lm-layers 2,4,6,8]
       [--json OUT]
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


def prefix_inputs(lm: object, sample: R.Sample) -> tuple[torch.Tensor, torch.Tensor, int, object, int]:
    """The video's prefix as the LM receives it at inference (system turn, then the video): its embeddings
    ``[1, Lp, hidden]``, positions ``[3, 1, Lp]``, the position after it, its layout and its visual-token
    count."""
    from decoders.model import VisualInputs

    grid = torch.tensor([sample.grid_thw])
    vis = torch.stack(list(lm.model.model.get_video_features(sample.pixel_values, grid).pooler_output))
    n_vis = vis.shape[1]
    layout = lm.prefix_ids(n_vis)
    head = lm.embed(torch.tensor([layout.ids[: layout.visual_start]]))
    visual = VisualInputs(pixel_values=sample.pixel_values[:0], num_tokens=n_vis, grid_thw=sample.grid_thw)
    pos, next_pos = lm.prefix_positions(layout, visual)
    return torch.cat([head, vis], dim=1), pos, next_pos, layout, n_vis


def lm_visual_hidden(lm: object, sample: R.Sample, layers: list[int]) -> dict[int, torch.Tensor]:
    """The LM's hidden states at the visual positions after each of `layers` (`[n_visual, hidden]`, as the
    layers wrote them), prefix only."""
    emb, pos, _, layout, n_vis = prefix_inputs(lm, sample)
    out = lm.text_model(inputs_embeds=emb, position_ids=pos, use_cache=False, output_hidden_states=True)
    return {
        layer: out.hidden_states[layer][0, layout.visual_start : layout.visual_start + n_vis]
        for layer in layers
    }


def lm_visual_states(lm: object, sample: R.Sample, layers: list[int]) -> dict[int, torch.Tensor]:
    """`lm_visual_hidden`, RMS-normalised."""
    return {layer: F.rms_norm(h, (h.shape[-1],)) for layer, h in lm_visual_hidden(lm, sample, layers).items()}


def fit_probe(x: torch.Tensor, y: torch.Tensor, classes: int, steps: int = 400) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(lin(x), y).backward()
        opt.step()
    return lin


def probe(model_dir: str, videos: int, frames: int, lm_layers: list[int] | None = None) -> dict:
    lm = load_model(model_dir, device="cpu")
    feats, labels = [], []
    layer_feats: dict[int, list[torch.Tensor]] = {layer: [] for layer in lm_layers or []}
    with torch.no_grad():
        for i in range(videos):
            rng = np.random.default_rng(PROBE_SEED0 + i)
            s = R.make_sample(lm, rng, frames, 2.0, R.FRAME_SIDE, codec=True)
            labels.append(s.aux)
            if not layer_feats:
                feats.append(visual_tokens(lm, s))
                continue
            # one vision-tower pass: the LM's layer-0 states at the visual positions are the merger output
            states = lm_visual_states(lm, s, sorted({0, *layer_feats}))
            feats.append(states[0])
            for layer in layer_feats:
                layer_feats[layer].append(states[layer])
    out = {"model": model_dir, "videos": videos, "frames_per_video": frames}
    out["attributes"] = _probe_all(feats, labels)
    if layer_feats:
        out["lm_layers"] = {str(layer): _probe_all(f, labels) for layer, f in layer_feats.items()}
    return out


def _probe_all(feats: list[torch.Tensor], labels: list[torch.Tensor]) -> dict:
    """Fit on the first 70% of the videos, test on the rest: accuracy and majority baseline per attribute."""
    split = int(0.7 * len(feats))
    result = {}
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
        result[name] = {
            "probe_accuracy": round(acc, 3),
            "majority": round(majority, 3),
            "train_tokens": len(ytr),
            "test_tokens": len(yte),
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, help="checkpoint dir (repeatable)")
    p.add_argument("--videos", type=int, default=48)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lm-layers", default="", help="e.g. 2,4,6,8: also probe the LM's visual positions")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.lm_layers.split(",") if x]
    results = []
    for m in args.model:
        r = probe(m, args.videos, args.frames, layers)
        results.append(r)
        rows = [("merger", r["attributes"])] + [
            (f"LM layer {k}", v) for k, v in r.get("lm_layers", {}).items()
        ]
        for where, attrs in rows:
            for name, a in attrs.items():
                print(
                    f"{m} {where}: {name:9s} probe {a['probe_accuracy']:.3f}  majority {a['majority']:.3f}",
                    file=sys.stderr,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
