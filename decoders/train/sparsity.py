"""How concentrated text->visual attention is: the premise of StD's sparse draft cache.

Contract
--------
* ``visual_attention_scores(lm, session, question)``: per layer, ``[Hkv, n_visual]`` attention mass the
  prompt-suffix queries (``lm.suffix_ids(question)``: question, end of turn, assistant header) put on each
  visual key, summed over the queries and over each GQA query group (post-RoPE q.k, causal softmax over the
  whole cache: system turn, visual tokens, suffix). Recorded by ``decoders.attention.record_visual_attention``
  in the model's own attention function (registered in both ``AttentionInterface`` and
  ``AttentionMaskInterface``), so the numbers are those of the real forward pass.
* ``topk_share(scores, k)``: per layer and KV head, the share of that visual mass held by the ``k``
  highest-scoring visual entries (1.0 when there are at most ``k`` visual tokens).
* ``measure_sparsity(model_dir, lengths=("short", "long"), ...) -> dict``: over held-out evaluation videos
  (the same worlds and mp4 files as ``decoders.train.eval``) and several questions each: per length the
  visual token counts, ``share_top{k}`` per layer (mean over KV heads and prompts), the per-(layer, head)
  table, the mean, the minimum, the uniform baseline ``k / n_visual``, and the share of all suffix attention
  that goes to visual keys at all (``visual_mass_share``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from decoders.protocol import after_list, ask_object_list, captions_after_list, trained_with_turns
from decoders.train import world as W
from decoders.train.eval import CAPTION_PROMPT, SETTINGS, eval_video
from decoders.train.reference import EVAL_SEED0

__all__ = ["measure_sparsity", "topk_share", "visual_attention_scores"]


@torch.inference_mode()
def visual_attention_scores(lm: object, session: object, question: str) -> tuple[list[torch.Tensor], float]:
    """Per-layer ``[Hkv, n_visual]`` suffix->visual attention mass, and the visual share of all suffix mass."""
    from decoders.attention import record_visual_attention

    ids = lm.suffix_ids(question)
    vs, ve = session.visual_span
    n_q = len(ids)
    with session.prompt(), record_visual_attention((vs, ve)) as rec:
        session.extend(ids)
    scores = [rec.scores[layer][0].float() for layer in sorted(rec.scores)]  # [Hkv, n_visual]
    group = lm.num_heads // lm.num_kv_heads
    total = n_q * group  # every (query, query head) row sums to 1 over all keys
    visual_share = float(np.mean([s.sum(-1).mean().item() / total for s in scores]))
    return scores, visual_share


def topk_share(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores`` [..., n_visual] -> [...]: share of the mass held by the top ``k`` entries."""
    n = scores.shape[-1]
    if n <= k:
        return torch.ones(scores.shape[:-1])
    top = torch.topk(scores, k, dim=-1).values.sum(-1)
    return top / scores.sum(-1).clamp_min(1e-30)


def measure_sparsity(
    model_dir: str | os.PathLike,
    lengths: Sequence[str] = ("short", "long"),
    n_videos: int | dict[str, int] = 2,
    questions_per_video: int = 4,
    ks: Sequence[int] = (64, 256, 1024),
    seed0: int = EVAL_SEED0,
    work_dir: str | os.PathLike = "runtime/eval",
    lm: object | None = None,
    log: object = print,
) -> dict:
    """See the module docstring."""
    from decoders.model import load_model
    from decoders.session import VisualSession
    from decoders.video import read_video

    if lm is None:
        lm = load_model(model_dir, device="cpu")
    turns = trained_with_turns(model_dir)
    cap_turns = captions_after_list(model_dir)  # implies turns
    work = Path(work_dir)
    out: dict = {"model": str(model_dir), "ks": list(ks), "lengths": {}}
    for name in lengths:
        setting = SETTINGS[name]
        count = n_videos.get(name, 2) if isinstance(n_videos, dict) else n_videos
        shares: dict[int, list[torch.Tensor]] = {k: [] for k in ks}  # each [layers, Hkv]
        vis_share: list[float] = []
        tokens: list[int] = []
        for i in range(count):
            seed = seed0 + setting.seed_offset + i
            world, path = eval_video(setting, seed, work)
            sampling = lm.default_sampling(fps=setting.fps, max_frames=setting.max_frames)
            visual = lm.prepare_video(read_video(path, sampling), sampling)
            session = VisualSession.create(lm, visual)
            tokens.append(visual.num_tokens)
            rng = np.random.default_rng([seed, 11])
            qs = [q.question for q in W.questions(world, rng)]
            picks = [qs[j] for j in rng.permutation(len(qs))[: max(0, questions_per_video - 1)]]
            caption = CAPTION_PROMPT
            if turns:  # asked as the model is: after its own object list (decoders.protocol)
                listed = ask_object_list(lm, session)
                picks = [after_list(listed, q) for q in picks]
                caption = after_list(listed, CAPTION_PROMPT) if cap_turns else caption
            for q in [caption, *picks]:
                scores, vshare = visual_attention_scores(lm, session, q)
                stacked = torch.stack(scores)  # [layers, Hkv, n_visual]
                for k in ks:
                    shares[k].append(topk_share(stacked, k))
                vis_share.append(vshare)
            if log:
                log(f"[sparsity {name} {i + 1}/{count}] {visual.num_tokens} visual tokens")
            del session
        entry: dict = {
            "n_videos": count,
            "prompts": len(vis_share),
            "visual_tokens": {"min": min(tokens), "mean": float(np.mean(tokens)), "max": max(tokens)},
            "visual_mass_share": float(np.mean(vis_share)),
        }
        for k in ks:
            s = torch.stack(shares[k])  # [prompts, layers, Hkv]
            per_lh = s.mean(0)  # [layers, Hkv]
            entry[f"share_top{k}"] = {
                "mean": float(per_lh.mean()),
                "min": float(s.min()),
                "per_layer": [round(float(x), 4) for x in per_lh.mean(-1)],
                "per_layer_head": [[round(float(x), 4) for x in row] for row in per_lh],
                "uniform_baseline": float(min(1.0, k / float(np.mean(tokens)))),
            }
        out["lengths"][name] = entry
        if log:
            t = entry.get("share_top1024", {})
            log(
                f"[sparsity {name}] top-1024 share {t.get('mean', float('nan')):.3f} (min {t.get('min', 0):.3f})"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vidspec sparsity", description="Top-K share of text->visual attention.")
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--lengths", default="short,long")
    p.add_argument("--n-videos", type=int, default=2)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--work-dir", default="runtime/eval")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    res = measure_sparsity(
        args.model,
        lengths=[s for s in args.lengths.split(",") if s],
        n_videos=args.n_videos,
        questions_per_video=args.questions,
        work_dir=args.work_dir,
    )
    text = json.dumps(res, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
