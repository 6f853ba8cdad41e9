"""Can the reference architecture learn to read an object list? A text-only probe.

The traced answers of v7-v10 list the video's objects right and then fail to read the answer from that list
(README, sections v7-v10). This script isolates the reading: a fresh model of the reference size (random
weights, no video) is trained only on list-reading drills (``reference.drill_task``: a traced question, the
list of a random world of 1-10 objects, `` . ``, the answer; only the answer is supervised), and its
teacher-forced accuracy on the answer's first token is measured on held-out drills, per question type, as
training goes. Variants change one thing of the architecture (the text RoPE base, the layer count), so the
curves say what the model needs to learn the lookup at all.

    python benchmarks/list_reading.py --variants theta=1e6,theta=1e4 --steps 1500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoders.model import VideoLM
from decoders.train import reference as R
from decoders.train import world as W

ATTN_LAYERS = (3, 5, 7)  # the training recipe's supervised layers (query head 0)


def parse_variant(text: str) -> dict[str, float]:
    """``"theta=1e4;layers=4"`` -> ``{"theta": 1e4, "layers": 4.0}`` (ValueError on an unknown key)."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(";")):
        key, _, value = part.partition("=")
        if key not in ("theta", "layers"):
            raise ValueError(f"unknown variant key {key!r} (theta, layers)")
        out[key] = float(value)
    return out


def build_model(tok_dir: Path, variant: dict[str, float], seed: int) -> VideoLM:
    size = R.SIZES["reference"]
    if "layers" in variant:
        size = replace(size, layers=int(variant["layers"]))
    lm = R.build_lm(tok_dir, size, seed)
    if "theta" in variant:
        from transformers import Qwen2VLForConditionalGeneration

        config = lm.model.config
        config.text_config.rope_parameters["rope_theta"] = float(variant["theta"])
        torch.manual_seed(seed)
        lm.model = Qwen2VLForConditionalGeneration(config)
    return lm


def decision_ids(lm: VideoLM, task: R.Task) -> frozenset[int]:
    """The tokens of a scan's trace that follow from the list and the question: a lookup's ``,`` (go on) and
    ``.`` (stop here), a filtered count's running count words (its separators follow the list's length)."""
    if task.kind in W.COUNTING_QTYPES:
        return frozenset(i for w in W.NUMBER_WORDS for i in lm.encode_text(w))
    return frozenset(lm.encode_text(", ."))


def encode_drills(
    lm: VideoLM, tasks: list[R.Task], decisions: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids, targets (-100 but for the answer after the trace, and with ``decisions`` a scan's decision
    tokens, ``decision_ids``) and the first answer target's mask."""
    head = lm.prefix_ids(0).ids  # the system turn and user header of a video prompt, with no video
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    period = lm.tokenizer.convert_tokens_to_ids(".")
    rows, tgts, firsts = [], [], []
    for t in tasks:
        prompt = head + lm.suffix_ids(t.prompt)
        ans = [*lm.encode_text(t.answer), im_end]
        k0 = R._answer_start(ans[:-1], period)
        rows.append(prompt + ans)
        tgt = R.answer_targets(ans, k0, drill=True)
        if decisions:
            tgt = [a if k < k0 and a in decision_ids(lm, t) else g for k, (a, g) in enumerate(zip(ans, tgt))]
        tgts.append([-100] * (len(prompt) - 1) + tgt + [-100])
        firsts.append(len(prompt) - 1 + k0)
    n = max(map(len, rows))
    pad = lm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = torch.full((len(rows), n), pad)
    tg = torch.full((len(rows), n), -100)
    first = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, (r, t, f) in enumerate(zip(rows, tgts, firsts, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        tg[i, : len(t)] = torch.tensor(t)
        first[i, f] = True
    return ids, tg, first


def encode_after(
    lm: VideoLM, rng: np.random.Generator, n: int, queries: int, cue: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """The list first, the questions after it (``--style after``): each sequence is a first turn answered with
    a random world's object list (``world.object_list``), then ``queries`` turns, each a traced-type question
    about that list answered with the answer alone (with ``cue``: the question's cue, `` . ``, then the answer,
    so the word the lookup matches is the token just before the answer).
    Returns ids, targets (every reply token), the mask of the positions predicting each answer's first token
    and their question types, in order."""
    head = lm.prefix_ids(0).ids
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows, tgts, firsts, kinds = [], [], [], []
    for _ in range(n):
        world = W.make_world(
            int(rng.integers(0, R.EVAL_SEED0)), 600.0, 2.0, 112, 112, int(rng.integers(1, 11))
        )
        row = head + lm.suffix_ids(R.CAPTION_PROMPTS[0]) + lm.encode_text(W.object_list(world))
        supervised = [False] * len(row)
        fs = []
        for _ in range(queries):
            qs = [q for q in W.questions(world, rng) if q.qtype in W.TRACED_QTYPES]
            q = qs[int(rng.integers(len(qs)))]
            close = "" if fs else "<|im_end|>"  # the list's turn is still open; an answer closes its own
            turn = lm.encode_text(
                f"{close}\n<|im_start|>user\n{q.question}<|im_end|>\n<|im_start|>assistant\n"
            )
            lead = lm.encode_text(f"{q.cue} .") if cue and q.cue else []
            ans = [*lead, *lm.encode_text(q.answer), im_end]
            fs.append(len(row) + len(turn) + len(lead) - 1)
            kinds.append(q.qtype)
            row += turn + ans
            supervised += [False] * len(turn) + [True] * len(ans)
        rows.append(row)
        # position k predicts token k + 1
        tgts.append([t if sup else -100 for t, sup in zip(row[1:], supervised[1:], strict=True)])
        firsts.append(fs)
    width = max(map(len, rows))
    pad = lm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = torch.full((n, width), pad)
    tg = torch.full((n, width), -100)
    first = torch.zeros(n, width, dtype=torch.bool)
    for i, (r, t, fs) in enumerate(zip(rows, tgts, firsts, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        tg[i, : len(t)] = torch.tensor(t)
        first[i, fs] = True
    return ids, tg, first, kinds


def item_mask(lm: VideoLM, tasks: list[R.Task], ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``[b, L]``: the trace tokens of each drill's referenced items (``Task.refs``: the matched object, the one
    after it for ``*_after``, the counted ones), items being the runs of tokens between the trace's commas."""
    comma = lm.tokenizer.convert_tokens_to_ids(",")
    start = lm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    header = len(lm.encode_text("<|im_start|>assistant\n"))
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, t in enumerate(tasks):
        k0 = int(first[i].nonzero()[0, 0]) + 1  # the first answer token's position
        a0 = max(k for k in range(k0) if int(ids[i, k]) == start) + header  # the assistant turn's first token
        item = 0
        for k in range(a0, k0 - 1):  # the trace, without its closing " ."
            tok = int(ids[i, k])
            if tok == comma:
                item += 1
            elif item in t.refs:
                mask[i, k] = True
    return mask


def forward(lm: VideoLM, ids: torch.Tensor, attentions: bool = False) -> tuple[torch.Tensor, tuple | None]:
    """Logits, and with ``attentions`` every layer's attention probabilities (eager attention)."""
    pos = torch.arange(ids.shape[1])[None, None].expand(3, ids.shape[0], -1)
    out = lm.text_model(
        inputs_embeds=lm.embed(ids), position_ids=pos, use_cache=False, output_attentions=attentions
    )
    return lm.lm_head(out.last_hidden_state), out.attentions if attentions else None


def logits_of(lm: VideoLM, ids: torch.Tensor) -> torch.Tensor:
    return forward(lm, ids)[0]


def run_variant(name: str, args: argparse.Namespace) -> dict:
    variant = parse_variant(name)
    with tempfile.TemporaryDirectory() as tmp:
        lm = build_model(Path(tmp), variant, args.seed)
    if args.attn_weight > 0:
        lm.model.config._attn_implementation = "eager"
        lm.model.config.text_config._attn_implementation = "eager"
    lm.model.train()
    params = [p for n, p in lm.model.named_parameters() if "visual" not in n]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    held_rng = np.random.default_rng([args.seed, 1 << 40])  # no training step draws from this stream
    decisions = args.style in ("scan", "cued")
    if args.style == "after":
        h_ids, h_tg, h_first, h_kinds = encode_after(lm, held_rng, args.held_out, 1, args.cue)
        kinds = np.array(h_kinds)
    else:
        held = [R.drill_task(held_rng, args.style) for _ in range(args.held_out)]
        h_ids, h_tg, h_first = encode_drills(lm, held, decisions)
        kinds = np.array([t.kind for t in held])
    curve = []
    losses: list[float] = []  # training losses since the last evaluation
    attn_mass: list[float] = []  # with --attn-weight: the supervised heads' mass on the items read
    start = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            lm.model.eval()
            with torch.no_grad():
                logits = logits_of(lm, h_ids)
            right = (logits[h_first].argmax(-1) == h_tg[h_first]).numpy()
            dec = (h_tg != -100) & ~h_first
            dec_acc = (
                float((logits[dec].argmax(-1) == h_tg[dec]).float().mean()) if dec.any() else float("nan")
            )
            lm.model.train()
            rec = {
                "step": step,
                "minutes": round((time.perf_counter() - start) / 60, 2),
                "accuracy": round(float(right.mean()), 4),
                "decision_accuracy": round(dec_acc, 4),
                "train_loss": round(float(np.mean(losses)), 4) if losses else None,
                "attn_mass": round(float(np.mean(attn_mass)), 4) if attn_mass else None,
                "per_qtype": {str(k): round(float(right[kinds == k].mean()), 3) for k in sorted(set(kinds))},
            }
            curve.append(rec)
            losses, attn_mass = [], []
            print(
                f"[{name}] step {step} ({rec['minutes']} min) acc {rec['accuracy']:.3f} decisions {dec_acc:.3f} "
                f"loss {rec['train_loss']} mass {rec['attn_mass']} {rec['per_qtype']}",
                flush=True,
            )
        if step == args.steps:
            break
        rng = np.random.default_rng([args.seed, step])
        if args.style == "after":
            tasks = []
            ids, tg, first, _ = encode_after(lm, rng, args.batch, args.queries, args.cue)
        else:
            tasks = [R.drill_task(rng, args.style) for _ in range(args.batch)]
            ids, tg, first = encode_drills(lm, tasks, decisions)
        lr = args.lr * min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr
        logits, attn = forward(lm, ids, attentions=args.attn_weight > 0)
        sel = tg != -100
        loss = F.cross_entropy(logits[sel], tg[sel])
        if attn is not None:  # head 0 of some layers, at the answer's first prediction, on the items read
            items = item_mask(lm, tasks, ids, first)
            rows = first & items.any(1, keepdim=True)  # ``first``: the position predicting the answer
            mass = torch.stack(
                [(attn[layer][:, 0] * items[:, None, :]).sum(-1)[rows] for layer in ATTN_LAYERS]
            )
            loss = loss + args.attn_weight * -torch.log(mass.clamp_min(1e-6)).mean()
            attn_mass.append(float(mass.detach().mean()))
        losses.append(float(loss.detach()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"[{name}] loss is {float(loss.detach())} at step {step}")
    return {"variant": name, "curve": curve, "final_accuracy": curve[-1]["accuracy"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--variants", default="theta=1e6", help="comma-separated; keys joined by ';' (theta, layers)"
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64, help="drills per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--style",
        default="list",
        choices=(*W.TRACE_STYLES, "after"),
        help="a trace style (the question, then the trace and the answer), or 'after': the list in a first "
        "turn, then questions answered alone in later turns (encode_after)",
    )
    p.add_argument("--queries", type=int, default=1, help="with --style after: question turns per list")
    p.add_argument(
        "--cue",
        action="store_true",
        help="with --style after: each reply is the question's cue, ' . ', the answer",
    )
    p.add_argument(
        "--attn-weight",
        type=float,
        default=0.0,
        help="supervise query head 0 of layers 3,5,7, at the position predicting the answer, to attend to the "
        "trace's items the answer is read from (-log mass, times this weight); 0 = off",
    )
    p.add_argument("--held-out", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [run_variant(v, args) for v in args.variants.split(",")]
    out = {"args": vars(args), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
