"""Where is an object's motion direction lost between the visual KV and the list turn's direction word?

``benchmarks/vision_probe.py`` shows that direction is linearly readable from single visual tokens; the
two-turn models (v18, v19) still write the directions of their object lists at chance. This diagnostic
teacher-forces the world's list (``world.object_list``) after the list prompt on held-out clips (seeds as
``vision_probe``'s, never trained on) and, at every position that predicts an item's direction word:

- ``model``: how often the model's own next-token choice among the direction words is right;
- ``position``: a linear probe's test accuracy for the direction on the hidden state after each decoder layer;
- ``oracle``: the same probe on the mean of the item's object's visual-token states after each layer (what
  an attention spread evenly over the object would read, before the value projection);
- ``attention``: the share of each layer's and query head's attention that lands on that object's visual
  tokens (mean over the positions).

The probes are fitted on the first 70% of the clips and tested on the rest; ``majority``: always answering
the most common training label.

    python benchmarks/direction_readout.py --model runtime/v19-export --videos 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
from vision_probe import PROBE_SEED0, fit_probe, prefix_inputs

from decoders.model import load_model
from decoders.protocol import LIST_PROMPT
from decoders.train import reference as R
from decoders.train import world as W


def readout_rows(lm: object, sample: R.Sample, direction_ids: list[int]) -> list[dict]:
    """One row per listed object of ``sample`` that a sampled frame shows: its direction label, the model's
    choice among ``direction_ids``, the hidden states at the position predicting its direction word and the
    mean states of its visual tokens (``[layers + 1, hidden]`` each), and per-layer, per-head attention mass
    on its visual tokens (``[layers, heads]``)."""
    from transformers import DynamicCache

    text = lm.text_model
    emb, pos, next_pos, layout, n_vis = prefix_inputs(lm, sample)
    cache = DynamicCache(config=lm.model.config.text_config)
    pre = text(
        inputs_embeds=emb,
        position_ids=pos,
        cache=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    listed = lm.encode_text(W.object_list(sample.world))
    ids = lm.suffix_ids(LIST_PROMPT) + listed
    lp = layout.visual_start + n_vis
    spos = torch.arange(next_pos, next_pos + len(ids))[None, None].expand(3, 1, -1)
    layers = list(range(len(text.layers)))
    with R.captured_attention_inputs(text, layers) as captured:
        suf = text(
            inputs_embeds=lm.embed(torch.tensor([ids])),
            position_ids=spos,
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
        )
    logits = lm.lm_head(suf.last_hidden_state[0])
    start = len(ids) - len(listed)  # suffix index of the list's first token
    rows = []
    direction_set = set(direction_ids)
    comma_id = lm.tokenizer.convert_tokens_to_ids(",")
    item = 0
    for k, t in enumerate(listed):
        if t not in direction_set:
            item += t == comma_id
            continue
        at = start + k - 1  # the position predicting the direction word
        obj = sample.ranks == item + 1  # type: ignore[operator]
        if not obj.any():
            continue
        label = W.DIRECTIONS.index(sample.world.events[item].direction)
        choice = int(logits[at, direction_ids].argmax())
        mass = torch.zeros(len(layers), text.config.num_attention_heads)
        outs, projected = [], []
        for layer in layers:
            attn = text.layers[layer].self_attn
            hs, (cos, sin) = captured[layer]
            keys_all = cache.layers[layer].keys[0]  # [kv_heads, lp + len(ids), d]
            values_all = cache.layers[layer].values[0]
            for h in range(text.config.num_attention_heads):
                q = R.head_projection(
                    attn.q_proj,
                    hs[0, at : at + 1],
                    cos[0, at : at + 1],
                    sin[0, at : at + 1],
                    h,
                    attn.head_dim,
                )
                keys = keys_all[h // attn.num_key_value_groups, : lp + at + 1]
                p = torch.softmax((q @ keys.T * attn.scaling)[0], dim=-1)
                mass[layer, h] = p[layout.visual_start : layout.visual_start + n_vis][obj].sum()
                if h == 0:
                    o = p @ values_all[0, : lp + at + 1]
                    w_o = attn.o_proj.weight[:, : attn.head_dim]  # head 0's slice of the output projection
                    outs.append(o)
                    projected.append(o @ w_o.T)
        rows.append(
            {
                "label": label,
                "right": choice == label,
                "position": torch.stack([hs_l[0, at] for hs_l in suf.hidden_states]),
                "oracle": torch.stack(
                    [
                        h_l[0, layout.visual_start : layout.visual_start + n_vis][obj].mean(0)
                        for h_l in pre.hidden_states
                    ]
                ),
                "attention": mass,
                "head0_out": torch.stack(outs),
                "head0_written": torch.stack(projected),
            }
        )
    return rows


def _probe(rows_tr: list[dict], rows_te: list[dict], key: str, layer: int) -> float:
    xtr = F.rms_norm(torch.stack([r[key][layer] for r in rows_tr]), (rows_tr[0][key].shape[-1],))
    xte = F.rms_norm(torch.stack([r[key][layer] for r in rows_te]), (rows_te[0][key].shape[-1],))
    ytr = torch.tensor([r["label"] for r in rows_tr])
    yte = torch.tensor([r["label"] for r in rows_te])
    lin = fit_probe(xtr, ytr, len(W.DIRECTIONS))
    with torch.no_grad():
        return round(float((lin(xte).argmax(-1) == yte).float().mean()), 3)


def readout(model_dir: str, videos: int, frames: int) -> dict:
    lm = load_model(model_dir, device="cpu")
    direction_ids = [lm.encode_text(d)[0] for d in W.DIRECTIONS]
    per_video = []
    with torch.no_grad():
        for i in range(videos):
            rng = np.random.default_rng(PROBE_SEED0 + i)
            s = R.make_sample(lm, rng, frames, 2.0, R.FRAME_SIDE, codec=True)
            per_video.append(readout_rows(lm, s, direction_ids))
    split = int(0.7 * videos)
    tr = [r for v in per_video[:split] for r in v]
    te = [r for v in per_video[split:] for r in v]
    n_layers = tr[0]["position"].shape[0]
    ytr = torch.tensor([r["label"] for r in tr])
    majority = float(np.mean([r["label"] == int(torch.bincount(ytr).argmax()) for r in te]))
    attention = torch.stack([r["attention"] for r in tr + te]).mean(0)
    return {
        "model": model_dir,
        "videos": videos,
        "frames_per_video": frames,
        "items": {"train": len(tr), "test": len(te)},
        "model_right": round(float(np.mean([r["right"] for r in tr + te])), 3),
        "majority": round(majority, 3),
        "position": {str(layer): _probe(tr, te, "position", layer) for layer in range(n_layers)},
        "oracle": {str(layer): _probe(tr, te, "oracle", layer) for layer in range(n_layers)},
        "head0_out": {str(layer): _probe(tr, te, "head0_out", layer) for layer in range(n_layers - 1)},
        "head0_written": {
            str(layer): _probe(tr, te, "head0_written", layer) for layer in range(n_layers - 1)
        },
        "attention": [[round(float(x), 3) for x in row] for row in attention],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, help="checkpoint dir (repeatable)")
    p.add_argument("--videos", type=int, default=64)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = [readout(m, args.videos, args.frames) for m in args.model]
    for r in results:
        print(json.dumps(r), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
