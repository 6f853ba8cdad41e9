"""Where StD's acceptance is lost: which visual entries the sparse draft reads.

At one length, on the four caption requests, with a fixed draft length (so acceptance is comparable):
  prompt    StD: the top-K visual entries by the prompt suffix's attention, chosen once for all layers and
            KV heads (`selection="shared"`, as shipped) or per layer and KV head (`per_head`, the paper's)
  refresh   the same, re-gathered every N cycles from decayed scores of where committed tokens attend
            (`StDConfig.refresh_every` / `refresh_decay`, opt-in)
  oracle    the top-K entries by the attention of the whole vanilla answer (prompt + answer), known in
            advance, with the same selection rule: not a method, what a better guess of where the answer
            looks could reach at that budget
Every run is asserted token-identical to vanilla. Reported: acceptance (accepted / drafted), mean accepted
length (bonus counted), acceptance per draft position.
Usage: python benchmarks/std_selection.py --max-frames 2048 --budgets 1024,4096 --selections shared,per_head
       --refresh 4:0.5:1024
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from decoders.attention import record_visual_attention
from decoders.engine import run
from decoders.model import load_model
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.train.reference import CAPTION_PROMPTS
from decoders.video import read_video


class OracleStD(StDProposer):
    """StD whose draft cache is selected by the attention of the known answer (an upper bound, not a method)."""

    def __init__(self, config: StDConfig, answer: list[int]) -> None:
        super().__init__(config)
        self.answer = answer

    def prefill(self, session: VisualSession, prompt_ids: list[int], cfg: DecodeConfig) -> torch.Tensor:
        base = session.length
        with record_visual_attention(session.visual_span) as rec:  # the answer's attention, then discarded
            session.extend(prompt_ids + self.answer[:-1])
        session.truncate(base)
        hidden = super().prefill(session, prompt_ids, cfg)
        self.scores = [rec.scores[layer] for layer in range(len(session.cache.layers))]
        self._gather()  # same budget and text entries, visual entries chosen by the answer's attention
        return hidden


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--video", default="runtime/ref-long.mp4")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", type=int, default=2048)
    p.add_argument("--budgets", default="1024,4096")
    p.add_argument("--selections", default="shared,per_head")
    p.add_argument("--refresh", nargs="*", default=["4:0.5:1024", "4:0.5:4096"], help="every:decay:budget")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/std-selection.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    sampling = lm.default_sampling(fps=a.fps, max_frames=a.max_frames)
    visual = lm.prepare_video(read_video(a.video, sampling), sampling)
    session = VisualSession.create(lm, visual, headroom=a.max_new_tokens + 160)
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    vanilla = {q: run(session, lm.suffix_ids(q), cfg).tokens for q in CAPTION_PROMPTS}

    def measure(name: str, budget: int, make: callable, **extra: object) -> dict:
        acc = drafted = cycles = 0
        per_pos: list[int] = []
        for q in CAPTION_PROMPTS:
            out = run(session, lm.suffix_ids(q), cfg, make(q))
            if out.tokens != vanilla[q]:
                raise AssertionError(f"{name} budget {budget}: output differs from vanilla on {q!r}")
            s = out.stats
            acc, drafted, cycles = (
                acc + s.num_accepted_tokens,
                drafted + s.num_draft_tokens,
                cycles + s.num_drafts,
            )
            per_pos = [x + y for x, y in zip(per_pos + [0] * len(s.accepted_per_pos), s.accepted_per_pos)]
        row = {
            "selection": name,
            "budget": budget,
            **extra,
            "acceptance": acc / max(1, drafted),
            "mean_accepted_length": 1 + acc / max(1, cycles),
            "accepted_per_pos": [round(x / max(1, cycles), 3) for x in per_pos],
        }
        print(row, file=sys.stderr, flush=True)
        return row

    rows = []
    for budget in (int(x) for x in a.budgets.split(",")):
        for sel in a.selections.split(","):
            base = StDConfig(budget=budget, gamma=a.gamma, adaptive=False, selection=sel)
            rows.append(measure("prompt", budget, lambda _q, c=base: StDProposer(c), rule=sel))
            rows.append(measure("oracle", budget, lambda q, c=base: OracleStD(c, vanilla[q]), rule=sel))
    for spec in a.refresh:
        every, decay, budget = spec.split(":")
        c = StDConfig(
            budget=int(budget),
            gamma=a.gamma,
            adaptive=False,
            refresh_every=int(every),
            refresh_decay=float(decay),
        )
        rows.append(
            measure(
                "refresh",
                int(budget),
                lambda _q, c=c: StDProposer(c),
                rule=c.selection,
                every=int(every),
                decay=float(decay),
            )
        )
    print("| selection | rule | budget | acceptance | mean accepted length | accepted per draft position |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        name = r["selection"] + (f" (every {r['every']}, decay {r['decay']:g})" if "every" in r else "")
        pos = " ".join(f"{x:.2f}" for x in r["accepted_per_pos"][: a.gamma])
        print(
            f"| {name} | {r['rule']} | {r['budget']} | {r['acceptance']:.3f} | {r['mean_accepted_length']:.2f} |"
            f" {pos} |"
        )
    out = {"model": a.model, "video": a.video, "visual_tokens": session.num_visual_tokens, "gamma": a.gamma}
    with open(a.json, "w") as f:
        json.dump({**out, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
