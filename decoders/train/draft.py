"""Training a Sparrow draft head for a target model (`vidspec train-draft --target DIR`).

Contract:
- Data comes from the target itself on synthetic world videos (self-distillation): for each video and each
  prompt (the caption requests and the world's questions), the target's own greedy answer; then one dense
  pass over prompt + answer gives the target's final hidden states (the head's `h`) and next-token
  distributions (top-k, renormalised). IVSB: the target's middle-layer states at (a subsample of) the visual
  positions are kept as extra training context.
- Loss, per position j (pair (h_j, x_{j+1}) -> predicts x_{j+2}): soft cross-entropy against the target's
  distribution + `feature_weight` * smooth-L1 between the head's feature and the target's h_{j+1} (EAGLE's
  two losses: the distribution is what acceptance needs; the feature is what recursive drafting feeds on);
  optionally + `argmax_weight` * cross-entropy on the target's top-1 token (`--argmax-weight`, off by default).
- MTP: for steps s = 2..mtp_steps the head is fed its own step s-1 features in place of the target's
  (pair (g_j, x_{j+s})), as at draft time; step s's loss is weighted 0.8^(s-1).
- IVSB: with probability 0.5 a sequence is preceded by its video's middle-layer visual states (as layer
  inputs), so the head learns visual semantics during training; at inference it never sees visual tokens.
- AdamW, warm-up then cosine decay; deterministic by seed; progress printed; the head is saved beside the
  target (`sparrow/`) with its training settings.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from decoders.engine import run
from decoders.model import VideoLM, load_model
from decoders.proposers.sparrow import SparrowHead, init_head, save_head
from decoders.protocol import (
    LIST_PROMPT,
    after_list,
    ask_object_list,
    captions_after_list,
    trained_with_turns,
)
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.reference import CAPTION_PROMPTS
from decoders.train.world import make_world, questions, render_frames
from decoders.video import DecodedVideo


@dataclass(frozen=True)
class DraftTrainConfig:
    target: Path
    out: Path | None = None  # default: beside the target
    seed: int = 0
    n_videos: int = 48
    durations: tuple[float, ...] = (8.0, 16.0, 30.0, 60.0)
    long_durations: tuple[float, ...] = ()  # a few long videos (e.g. 1800) for length robustness
    n_long: int = 0
    fps: float = 2.0
    size: int = 224
    frame_pixels: int | None = None  # pin frame area (min = max pixels); default: the model's sampling rules
    max_new_tokens: int = 96
    steps: int = 1500
    lr: float = 1e-3
    warmup: int = 50
    mtp_steps: int = 3
    ivsb: bool = True
    ivsb_tokens: int = 48
    feature_weight: float = 0.2
    argmax_weight: float = 0.0  # + this * cross-entropy on the target's top-1 token (greedy acceptance)
    topk: int = 64
    minutes: float = 30.0  # wall-clock budget for the optimisation loop

    def __post_init__(self) -> None:
        if self.mtp_steps < 1 or self.steps < 1 or self.n_videos < 1:
            raise ValueError(f"bad draft training config: {self}")


@dataclass
class Sequence:
    ids: torch.Tensor  # [n] prompt + answer
    hidden: torch.Tensor  # [n, H] target final hidden states
    top_ids: torch.Tensor  # [n, k] target next-token top-k ids
    top_p: torch.Tensor  # [n, k] their renormalised probabilities
    visual: torch.Tensor | None  # [m, H] middle-layer states at visual positions (IVSB)
    video_tokens: int


def _video(seed: int, duration: float, fps: float, size: int) -> tuple[DecodedVideo, object]:
    world = make_world(seed, duration, fps=fps, width=size, height=size)
    frames = np.stack(list(render_frames(world)))
    n = frames.shape[0] - frames.shape[0] % 2
    frames = frames[: max(n, 2)]
    video = DecodedVideo(
        frames=frames,
        timestamps=np.arange(frames.shape[0]) / fps,
        sample_fps=fps,
        source_fps=fps,
        duration_s=duration,
        total_frames=frames.shape[0],
    )
    return video, world


@torch.inference_mode()
def collect(lm: VideoLM, cfg: DraftTrainConfig, log: callable = print) -> list[Sequence]:
    """Run the target on synthetic videos; return training sequences (see the module docstring)."""
    rng = np.random.default_rng(cfg.seed)
    mid = lm.num_layers // 2
    captured: dict[str, torch.Tensor] = {}

    def hook(_module: object, _args: object, output: object) -> None:
        captured["mid"] = output[0] if isinstance(output, tuple) else output

    plan = [(float(rng.choice(cfg.durations)), 1000 + i) for i in range(cfg.n_videos)]
    plan += (
        [(float(rng.choice(cfg.long_durations)), 5000 + i) for i in range(cfg.n_long)]
        if cfg.long_durations
        else []
    )
    out: list[Sequence] = []
    turns = trained_with_turns(lm.path)
    cap_turns = captions_after_list(lm.path)  # implies turns
    t0 = time.perf_counter()
    for vi, (duration, seed) in enumerate(plan):
        video, world = _video(seed + cfg.seed * 100_000, duration, cfg.fps, cfg.size)
        sampling = lm.default_sampling(fps=cfg.fps)
        if cfg.frame_pixels:
            sampling = replace(sampling, min_pixels=cfg.frame_pixels, max_pixels=cfg.frame_pixels)
        visual = lm.prepare_video(video, sampling)
        handle = lm.text_model.layers[mid].register_forward_hook(hook)
        try:
            session = VisualSession.create(lm, visual)
        finally:
            handle.remove()
        vs, ve = session.visual_span
        vis_states = None
        if cfg.ivsb and "mid" in captured:
            pick = np.linspace(vs, ve - 1, num=min(cfg.ivsb_tokens, ve - vs)).round().astype(int)
            vis_states = captured.pop("mid")[0, torch.as_tensor(pick)].clone()
        # every caption request the target was trained with (captions are the long answers drafts pay on), and
        # its questions as it is asked them: after its own object list when trained with two-turn QA (the
        # captions too when it was trained to caption after the list)
        asked = [qa.question for qa in questions(world, rng)]
        captions = list(CAPTION_PROMPTS)
        if turns:
            listed = ask_object_list(lm, session)
            asked = [LIST_PROMPT, *(after_list(listed, q) for q in asked)]
            if cap_turns:
                captions = [after_list(listed, c) for c in captions]
        prompts = [*captions, *asked]
        for prompt in prompts:
            ids = lm.suffix_ids(prompt)
            answer = run(session, ids, DecodeConfig(max_new_tokens=cfg.max_new_tokens)).tokens
            seq = ids + answer
            with session.prompt():
                hidden = session.extend(seq)[0]  # [n, H]
                probs = torch.softmax(lm.logits(hidden), dim=-1)
            k = min(cfg.topk, probs.shape[-1])
            top_p, top_ids = torch.topk(probs, k, dim=-1)
            out.append(
                Sequence(
                    ids=torch.tensor(seq),
                    hidden=hidden.clone(),
                    top_ids=top_ids,
                    top_p=top_p / top_p.sum(-1, keepdim=True),
                    visual=vis_states,
                    video_tokens=session.num_visual_tokens,
                )
            )
        del session
        log(
            f"  data {vi + 1}/{len(plan)}: {duration:g}s video, {visual.num_tokens} visual tokens, "
            f"{len(prompts)} prompts ({time.perf_counter() - t0:.0f}s)"
        )
    return out


def sequence_loss(
    head: SparrowHead, lm: VideoLM, seq: Sequence, cfg: DraftTrainConfig, use_visual: bool
) -> torch.Tensor:
    # (.clone() turns tensors made under inference_mode during collection into ordinary ones)
    ids, hidden = seq.ids.to(lm.device).clone(), seq.hidden.to(lm.device).clone()
    n = ids.shape[0]
    if n < 3:
        return torch.zeros((), device=lm.device)
    with torch.no_grad():
        emb = lm.embed(ids[None])[0]  # [n, H] frozen target embeddings
    prefix = seq.visual.to(lm.device).clone() if (use_visual and seq.visual is not None) else None
    m = 0 if prefix is None else prefix.shape[0]
    feats = hidden[:-1]  # step 1 uses the target's features h_0..h_{n-2}
    total = torch.zeros((), device=lm.device)
    for s in range(1, cfg.mtp_steps + 1):
        count = n - 1 - s  # pairs (feat_j, x_{j+s}) whose target x_{j+s+1} exists
        if count <= 0:
            break
        x = head.fuse(emb[s : s + count], feats[:count])  # [count, H]
        if prefix is not None:
            x = torch.cat([prefix, x], dim=0)
        g = head.layer(x[None], torch.arange(x.shape[0], device=lm.device))[0, m:]  # [count, H]
        logp = torch.log_softmax(lm.logits(g), dim=-1)  # [count, V]
        tgt_ids = seq.top_ids[s : s + count].to(lm.device).clone()
        tgt_p = seq.top_p[s : s + count].to(lm.device).clone()
        # KL(target || head) over the target's top-k (cross-entropy minus the target's entropy: floor 0)
        ce = (tgt_p * (torch.log(tgt_p.clamp_min(1e-12)) - logp.gather(-1, tgt_ids))).sum(-1).mean()
        feat_loss = F.smooth_l1_loss(g, hidden[s : s + count])
        loss = ce + cfg.feature_weight * feat_loss
        if cfg.argmax_weight:  # greedy acceptance needs the head's top-1 to be the target's (topk sorts)
            loss = loss + cfg.argmax_weight * F.nll_loss(logp, tgt_ids[:, 0])
        total = total + (0.8 ** (s - 1)) * loss
        feats = g  # MTP: the next step is fed the head's own features
    return total


def train(cfg: DraftTrainConfig, log: callable = print) -> Path:
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    lm = load_model(cfg.target, device="auto")
    for p in lm.model.parameters():
        p.requires_grad_(False)
    log(f"collecting data from {cfg.target} ({cfg.n_videos} videos + {cfg.n_long} long)...")
    data = collect(lm, cfg, log)
    log(f"{len(data)} sequences, {sum(len(s.ids) for s in data)} tokens")
    head = init_head(lm, seed=cfg.seed, ivsb=cfg.ivsb, mtp_steps=cfg.mtp_steps)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    t0 = time.perf_counter()
    ema = None
    step = 0
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * min(1.0, step / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = [data[rng.randrange(len(data))] for _ in range(8)]
        loss = sum(sequence_loss(head, lm, s, cfg, cfg.ivsb and rng.random() < 0.5) for s in batch) / len(
            batch
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        elapsed = time.perf_counter() - t0
        if step % 50 == 0 or step == 1:
            log(f"  step {step}/{cfg.steps} loss {ema:.4f} lr {lr:.2e} ({elapsed:.0f}s)")
        if elapsed > cfg.minutes * 60:
            log(f"  time budget of {cfg.minutes:g} min reached at step {step}")
            break
    head.eval()
    meta = {"trained": {**{k: str(v) for k, v in asdict(cfg).items()}, "final_step": step, "final_loss": ema}}
    path = save_head(head, cfg.out or cfg.target, extra=meta)
    log(f"saved the draft head to {path}")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument(
        "--out", help="a directory to hold the head, saved in its sparrow/ (default: the target's own)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--videos", type=int, default=48)
    p.add_argument("--long-videos", type=int, default=0)
    p.add_argument(
        "--long-duration",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=(1800.0,),
        help="seconds; a comma list draws each long video's duration from it",
    )
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mtp-steps", type=int, default=3)
    p.add_argument("--no-ivsb", action="store_true")
    p.add_argument(
        "--argmax-weight", type=float, default=0.0, help="extra cross-entropy on the target's top-1 token"
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: min(2, cores))")


def config_from_args(a: argparse.Namespace) -> DraftTrainConfig:
    return DraftTrainConfig(
        target=Path(a.target),
        out=Path(a.out) if a.out else None,
        seed=a.seed,
        n_videos=a.videos,
        n_long=a.long_videos,
        long_durations=a.long_duration if a.long_videos else (),
        fps=a.fps,
        size=a.size,
        steps=a.steps,
        lr=a.lr,
        mtp_steps=a.mtp_steps,
        ivsb=not a.no_ivsb,
        minutes=a.minutes,
        argmax_weight=a.argmax_weight,
    )


def main(argv: list[str] | None = None) -> int:
    """`vidspec train-draft`: parse arguments, train, save the head beside the target."""
    parser = argparse.ArgumentParser(prog="vidspec train-draft", description="Train a Sparrow draft head.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    train(config_from_args(args))
    return 0
