"""Sparrow ablations: mean accepted length and decode speedup over vanilla at a short and a long length,
for heads named on the command line, e.g.
  full       the shipped head (text-only attention: it never reads a visual token)
  no-ivsb    a head trained without IVSB
  mtp3       a head trained with recursive multi-token prediction over 3 steps
  visual     (added when `full` is given) the full head allowed to attend to the target's middle-layer visual
             states, i.e. without text-anchored attention
Heads are directories holding `sparrow/` (train them with `vidspec train-draft --target MODEL --out DIR ...`).
Every answer is asserted token-identical to vanilla; decode times are summed over the prompts.
Usage: python benchmarks/sparrow_ablation.py --model M --video V --heads full=M,no-ivsb=D1,mtp3=D2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from decoders.engine import run
from decoders.model import load_model
from decoders.proposers.sparrow import SparrowProposer, load_head
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.reference import CAPTION_PROMPTS
from decoders.video import read_video


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--video", required=True)
    p.add_argument("--heads", required=True, help="name=dir,... (dir holds sparrow/)")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", default="192,2048")
    p.add_argument("--visual-context", type=int, default=256, help="visual states the 'visual' variant sees")
    p.add_argument(
        "--questions",
        default="|".join(CAPTION_PROMPTS),
        help="'|'-separated; default: the four caption requests (long answers, where drafting matters)",
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/sparrow-ablation.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    heads = {k: load_head(v, lm) for k, v in (x.split("=", 1) for x in a.heads.split(","))}
    variants = [(name, head, 0) for name, head in heads.items()]
    if "full" in heads:
        variants.append(("visual", heads["full"], a.visual_context))
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    prompts = [lm.suffix_ids(q) for q in a.questions.split("|")]
    rows = []
    for mf in [int(x) for x in a.max_frames.split(",")]:
        sampling = lm.default_sampling(fps=a.fps, max_frames=mf)
        visual = lm.prepare_video(read_video(a.video, sampling), sampling)
        session = VisualSession.create(lm, visual, capture_layer=lm.num_layers // 2)
        for name, head, ctx in variants:
            accepted = drafts = 0
            van_s, got_s = [], []
            for _ in range(a.repeats):
                van_s.append(0.0)
                got_s.append(0.0)
                for prompt in prompts:
                    van = run(session, prompt, cfg)
                    got = run(session, prompt, cfg, SparrowProposer(head, visual_context=ctx))
                    assert got.tokens == van.tokens
                    accepted += got.stats.num_accepted_tokens
                    drafts += got.stats.num_drafts
                    van_s[-1] += van.stats.decode_s
                    got_s[-1] += got.stats.decode_s
            row = {
                "variant": name,
                "visual_tokens": session.num_visual_tokens,
                "mean_accepted_length": 1 + accepted / max(1, drafts),  # bonus token counted
                # decode time summed over the prompts; median over repeats
                "speedup_vs_vanilla": statistics.median(van_s) / max(statistics.median(got_s), 1e-9),
            }
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print("| variant | visual tokens | mean accepted length | decode speedup vs vanilla |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['visual_tokens']} | {r['mean_accepted_length']:.2f} | {r['speedup_vs_vanilla']:.2f}x |"
        )
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
