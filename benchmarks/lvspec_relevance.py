"""Which representation makes LVSpec's visual relevance find the visual anchors? (measured, not assumed)

On held-out eval videos (the worlds `vidspec eval` uses), the target's own greedy captions (all caption
requests) are scored token by token: relevance = mean of the top-N cosine similarities between the token's
representation and the video's visual representations, for
  input    the token's input embedding vs the vision tower's outputs (LVSpec's `--relevance-repr input`)
  final    the final hidden state at the token vs those at the visual positions (`--relevance-repr final`)
  layerL   the output of decoder layer L at the token vs at the visual positions (not offered by LVSpec:
           measured here to see whether any depth would do)
  lm_head  the token's output embedding (its `lm_head` row) vs the final states at the visual positions
Ground truth for "visual anchor" comes from the synthetic world: colour words and shape words (what caption
F1 scores), reported separately. Per representation: ROC AUC of relevance separating colour (shape) words from
the fillers (1.0: every anchor above every filler; 0.5: chance; 0.0: every anchor *below* every filler), and,
for the two offered representations, anchor recall and filler share at or above each threshold.
Usage: python benchmarks/lvspec_relevance.py --short 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from decoders.engine import run
from decoders.model import load_model
from decoders.proposers.lvspec import relevance_scores
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train import world as W
from decoders.train.eval import SETTINGS, eval_video
from decoders.train.reference import CAPTION_PROMPTS, EVAL_SEED0
from decoders.video import read_video


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(relevance of a random anchor > that of a random filler), ties counted half."""
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).float().mean() + 0.5 * (diff == 0).float().mean())


class LayerTap:
    """Forward hooks keeping every decoder layer's output (flattened to [tokens, H]) until cleared."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.layers, self.out, self.handles = layers, {}, []

    def __enter__(self) -> LayerTap:
        def keep(i: int) -> callable:
            def hook(_m: object, _a: object, output: object) -> None:
                o = output[0] if isinstance(output, tuple) else output
                self.out.setdefault(i, []).append(o.reshape(-1, o.shape[-1]))

            return hook

        self.out = {}
        self.handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def states(self, i: int) -> torch.Tensor:
        if i not in self.out:
            raise RuntimeError("layer hooks did not fire (the forward bypassed the transformers layers)")
        return torch.cat(self.out[i], dim=0)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--long", type=int, default=0)
    p.add_argument("--top-n", type=int, default=10)
    p.add_argument("--thresholds", default="0.1,0.2,0.3,0.4,0.5")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/lvspec-relevance.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    layers = lm.text_model.layers
    reps = ["input", "final", *(f"layer{i}" for i in range(len(layers))), "lm_head"]
    kinds = {"colour": set(W.COLOURS), "shape": set(W.SHAPES) | set(W.SHAPE_PLURALS.values())}
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    results: dict = {}
    print("| length | representation | colour words: AUC | shape words: AUC |")
    print("|---|---|---:|---:|")
    for length, count in (("short", a.short), ("long", a.long)):
        if count <= 0:
            continue
        setting = SETTINGS[length]
        rel: dict[str, list[torch.Tensor]] = {r: [] for r in reps}
        kind_of: list[str] = []
        for i in range(count):
            seed = EVAL_SEED0 + setting.seed_offset + i
            _world, path = eval_video(setting, seed, Path("runtime/eval"))
            sampling = lm.default_sampling(fps=setting.fps, max_frames=setting.max_frames)
            with LayerTap(layers) as tap:
                session = VisualSession.create(lm, lm.prepare_video(read_video(path, sampling), sampling))
            vs, ve = session.visual_span
            vis = {f"layer{j}": F.normalize(tap.states(j)[vs:ve].float(), dim=-1) for j in range(len(layers))}
            vis.update(input=session.visual_states["input"], final=session.visual_states["final"])
            vis["lm_head"] = session.visual_states["final"]
            for prompt in CAPTION_PROMPTS:
                ids = lm.suffix_ids(prompt)
                answer = run(session, ids, cfg).tokens
                seq = torch.tensor([ids + answer], device=lm.device)
                with session.prompt(), LayerTap(layers) as tap:  # the transformers forward (hooks fire)
                    pos = lm.text_positions(session.length + session.rope_delta, seq.shape[1])
                    hidden = lm.forward(pos, session.cache, input_ids=seq)[
                        0, len(ids) :
                    ]  # [n, H] per answer token
                tokens = torch.tensor(answer, device=lm.device)
                states = {
                    "input": lm.embed(tokens[None])[0],
                    "final": hidden,
                    "lm_head": lm.model.lm_head.weight[tokens],
                    **{f"layer{j}": tap.states(j)[len(ids) :] for j in range(len(layers))},
                }
                for r in reps:
                    rel[r].append(relevance_scores(states[r], vis[r], a.top_n).cpu())
                words = [lm.tokenizer.decode([t]).strip() for t in answer]
                kind_of += [next((k for k, ws in kinds.items() if w in ws), "filler") for w in words]
            print(
                f"[{length} {i + 1}/{count}] {session.num_visual_tokens} visual tokens",
                file=sys.stderr,
                flush=True,
            )
        mask = {k: torch.tensor([x == k for x in kind_of]) for k in (*kinds, "filler")}
        res: dict = {
            "tokens": len(kind_of),
            **{f"{k}_share": float(m.float().mean()) for k, m in mask.items()},
        }
        thresholds = [float(x) for x in a.thresholds.split(",")]
        for r in reps:
            v = torch.cat(rel[r])
            row = {f"{k}_auc": auc(v[mask[k]], v[mask["filler"]]) for k in kinds}
            row.update({f"{k}_mean": float(v[m].mean()) for k, m in mask.items()})
            if r in ("input", "final"):
                anchors = v[mask["colour"] | mask["shape"]]
                row["thresholds"] = [
                    {
                        "threshold": t,
                        "anchor_recall": float((anchors >= t).float().mean()),
                        "filler_above": float((v[mask["filler"]] >= t).float().mean()),
                    }
                    for t in thresholds
                ]
            res[r] = row
            print(f"| {length} | {r} | {row['colour_auc']:.3f} | {row['shape_auc']:.3f} |")
        results[length] = res
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "top_n": a.top_n, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
