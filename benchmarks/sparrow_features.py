"""Probe: does a Sparrow head draft better when it also gets the target's intermediate-layer states?

EAGLE-3 feeds its draft head a fusion of low, middle and high layer states instead of the last one. Our head
(`decoders/proposers/sparrow.py`) gets the target's final state h_j; on long videos its first draft misses
where the model decides from the video what comes next (colour, shape of an entering object). This probe
trains two heads side by side on the same self-distillation data, same seed, steps and loss:
- `last`: the shipped recipe (input fc(cat(norm(embed(x_{j+1})), h_j))),
- `multi`: the same plus a correction u_j = h_j + W cat(n(l2_j), n(l4_j), n(l6_j)) on the first draft step
  (W zero-initialised, so it starts as `last`; the residual stream after decoder layers 2, 4, 6, RMS-
  normalised), recursive steps fed the head's own features as before,
and measures teacher-forced draft accuracy at steps 1-3 on the bench video's captions at 1.5k and 25.6k visual
tokens, overall and where the target is unsure (top-1 probability < 0.5). Offline, no timing.

Usage (from the repo root; `collect` once, then the two `train` runs can go in parallel, then `eval`):
  python benchmarks/sparrow_features.py collect --videos 200 --long 8
  python benchmarks/sparrow_features.py train --variant last & python benchmarks/sparrow_features.py train \
      --variant multi; wait
  python benchmarks/sparrow_features.py eval
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from decoders.engine import run
from decoders.model import VideoLM, load_model
from decoders.proposers.sparrow import SparrowHead, init_head
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.draft import DraftTrainConfig, _video
from decoders.train.reference import CAPTION_PROMPTS
from decoders.train.world import questions
from decoders.video import read_video

WORK = Path("runtime/sparrow-features")
LAYERS = (1, 3, 5)  # outputs of decoder layers 2, 4, 6 (0-based indices)


def states(lm: VideoLM, session: VisualSession, seq: list[int]) -> dict[str, torch.Tensor]:
    """Target pass over `seq` inside the session's prompt scope: final hidden, the LAYERS' outputs, top-k."""
    got: dict[int, torch.Tensor] = {}
    handles = []
    for i in LAYERS:

        def hook(_m: object, _a: object, out: object, i: int = i) -> None:
            got[i] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

        handles.append(lm.text_model.layers[i].register_forward_hook(hook))
    try:
        with session.prompt():  # a kwarg forces the transformers forward (where the hooks fire)
            hidden = session.extend(seq, output_hidden_states=False)[0].clone()
    finally:
        for h in handles:
            h.remove()
    probs = torch.softmax(lm.logits(hidden), -1)
    top_p, top_ids = torch.topk(probs, min(64, probs.shape[-1]), -1)
    mid = torch.cat([F.rms_norm(got[i], (got[i].shape[-1],)) for i in LAYERS], -1)
    return {
        "ids": torch.tensor(seq),
        "hidden": hidden,
        "mid": mid,
        "top_ids": top_ids,
        "top_p": top_p / top_p.sum(-1, keepdim=True),
        "top1": probs.max(-1).values,
    }


@torch.inference_mode()
def collect(a: argparse.Namespace) -> None:
    lm = load_model(a.model, device="cpu")
    cfg = DraftTrainConfig(target=Path(a.model))
    rng = np.random.default_rng(0)
    plan = [(float(rng.choice(cfg.durations)), 1000 + i) for i in range(a.videos)]
    plan += [(600.0, 5000 + i) for i in range(a.long)]
    data = []
    t0 = time.perf_counter()
    mid_layer = lm.num_layers // 2
    for vi, (duration, seed) in enumerate(plan):
        video, world = _video(seed, duration, cfg.fps, cfg.size)
        sampling = lm.default_sampling(fps=cfg.fps)
        session = VisualSession.create(lm, lm.prepare_video(video, sampling), capture_layer=mid_layer)
        vis = session.visual_states["mid"]
        pick = torch.linspace(0, vis.shape[0] - 1, min(48, vis.shape[0])).round().long()
        for prompt in [*CAPTION_PROMPTS, *(qa.question for qa in questions(world, rng))]:
            ids = lm.suffix_ids(prompt)
            answer = run(session, ids, DecodeConfig(max_new_tokens=96)).tokens
            d = states(lm, session, ids + answer)
            d["visual"] = vis[pick].clone()
            data.append(d)
        print(f"  data {vi + 1}/{len(plan)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save(data, WORK / "train.pt")
    print(f"{len(data)} sequences, {sum(len(d['ids']) for d in data)} tokens")


class Fusion(nn.Module):
    """The `multi` variant's correction: u = h + W cat(mid states), W zero-initialised."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w = nn.Linear(len(LAYERS) * hidden, hidden, bias=False)
        nn.init.zeros_(self.w.weight)

    def forward(self, h: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
        return h + self.w(mid)


def step_outputs(
    head: SparrowHead, fusion: Fusion | None, lm: VideoLM, d: dict, steps: int, visual: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Teacher-forced MTP: for s = 1..steps, (features g [count, H], logprobs [count, V]) predicting x_{j+s+1}
    from pairs (feat_j, x_{j+s}) (step 1: the target's features; later steps: the head's own)."""
    ids, hidden = d["ids"], d["hidden"]
    n = ids.shape[0]
    emb = lm.embed(ids[None])[0].detach()
    feats = hidden[:-1]
    if fusion is not None:
        feats = fusion(feats, d["mid"][:-1])
    prefix = d["visual"] if visual else None
    m = 0 if prefix is None else prefix.shape[0]
    out = []
    for s in range(1, steps + 1):
        count = n - 1 - s
        if count <= 0:
            break
        x = head.fuse(emb[s : s + count], feats[:count])
        if prefix is not None:
            x = torch.cat([prefix, x], 0)
        g = head.layer(x[None], torch.arange(x.shape[0]))[0, m:]
        out.append((g, torch.log_softmax(lm.logits(g), -1)))
        feats = g
    return out


def train(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm = load_model(a.model, device="cpu")
    for p in lm.model.parameters():
        p.requires_grad_(False)
    data = [{k: v.clone() for k, v in d.items()} for d in torch.load(WORK / "train.pt")]
    head = init_head(lm, seed=0)
    fusion = Fusion(lm.hidden_size) if a.variant == "multi" else None
    params = list(head.parameters()) + ([] if fusion is None else list(fusion.parameters()))
    head.train()
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(0)
    t0, ema = time.perf_counter(), None
    for step in range(1, a.steps + 1):
        lr = 1e-3 * min(1.0, step / 50) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        total = torch.zeros(())
        for _ in range(8):
            d = data[rng.randrange(len(data))]
            if len(d["ids"]) < 3:
                continue
            for s, (g, logp) in enumerate(step_outputs(head, fusion, lm, d, 3, rng.random() < 0.5), 1):
                tid, tp = d["top_ids"][s : s + g.shape[0]], d["top_p"][s : s + g.shape[0]]  # of x_{j+s+1}
                ce = (tp * (torch.log(tp.clamp_min(1e-12)) - logp.gather(-1, tid))).sum(-1).mean()
                loss = ce + 0.2 * F.smooth_l1_loss(g, d["hidden"][s : s + g.shape[0]])
                loss = loss + F.nll_loss(logp, tid[:, 0])
                total = total + 0.8 ** (s - 1) * loss / 8
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = float(total.detach()) if ema is None else 0.95 * ema + 0.05 * float(total.detach())
        if step % 200 == 0:
            print(
                f"  {a.variant} step {step}/{a.steps} loss {ema:.4f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    torch.save(
        {"head": head.state_dict(), "fusion": None if fusion is None else fusion.state_dict()},
        WORK / f"head-{a.variant}.pt",
    )


@torch.inference_mode()
def evaluate(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device="cpu")
    heads = {}
    for variant in ("last", "multi"):
        saved = torch.load(WORK / f"head-{variant}.pt")
        head = init_head(lm, seed=0)
        head.load_state_dict(saved["head"])
        fusion = None
        if saved["fusion"] is not None:
            fusion = Fusion(lm.hidden_size)
            fusion.load_state_dict(saved["fusion"])
        heads[variant] = (head.eval(), fusion)
    if a.shipped:
        from decoders.proposers.sparrow import load_head

        heads["shipped"] = (load_head(a.model, lm), None)
    rows = []
    for mf in (int(x) for x in a.max_frames.split(",")):
        sampling = lm.default_sampling(fps=2.0, max_frames=mf)
        session = VisualSession.create(lm, lm.prepare_video(read_video(a.video, sampling), sampling))
        seqs = []
        for prompt in CAPTION_PROMPTS:
            ids = lm.suffix_ids(prompt)
            answer = run(session, ids, DecodeConfig(max_new_tokens=96)).tokens
            seqs.append((len(ids), states(lm, session, ids + answer)))
        for variant, (head, fusion) in heads.items():
            hits = np.zeros((3, 2))
            counts = np.zeros((3, 2))
            for plen, d in seqs:
                chain = None
                for s, (_, logp) in enumerate(step_outputs(head, fusion, lm, d, 3, False), 1):
                    # predictions of x_{j+s+1} for j = 0..count-1; drafts predict answer tokens after the first
                    tgt = d["ids"][s + 1 : s + 1 + logp.shape[0]]
                    ok = logp.argmax(-1) == tgt
                    unsure = d["top1"][s : s + logp.shape[0]] < 0.5  # the target's confidence at that token
                    j = torch.arange(logp.shape[0]) + s + 1 >= plen + 1
                    chain = ok if chain is None else chain[: ok.shape[0]] & ok  # all steps up to s right
                    for u in (0, 1):
                        sel = j & (unsure if u else ~unsure)
                        counts[s - 1, u] += int(sel.sum())
                        hits[s - 1, u] += int((chain & sel).sum())
            row = {
                "visual_tokens": session.num_visual_tokens,
                "variant": variant,
                "chain_accuracy_sure": (hits[:, 0] / np.maximum(counts[:, 0], 1)).round(4).tolist(),
                "chain_accuracy_unsure": (hits[:, 1] / np.maximum(counts[:, 1], 1)).round(4).tolist(),
                "chain_accuracy": (hits.sum(1) / np.maximum(counts.sum(1), 1)).round(4).tolist(),
                "positions": counts[0].astype(int).tolist(),
                "expected_accepted_length_gamma3": float(
                    1 + (hits.sum(1) / np.maximum(counts.sum(1), 1)).sum()
                ),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.json).write_text(json.dumps({"video": a.video, "layers": LAYERS, "rows": rows}, indent=2))
    print(f"wrote {a.json}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=["collect", "train", "eval"])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--videos", type=int, default=200)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--variant", choices=["last", "multi"], default="last")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--video", default="runtime/ref-long.mp4")
    p.add_argument("--max-frames", default="192,3200")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shipped", action="store_true", help="eval: also the model's shipped head")
    p.add_argument("--json", default="benchmarks/results/sparrow-features.json")
    a = p.parse_args()
    {"collect": collect, "train": train, "eval": evaluate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
