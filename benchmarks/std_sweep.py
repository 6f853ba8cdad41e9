"""A small sweep of StD's draft budget (K + text entries) and draft length gamma, side by side with vanilla.

One session per length is prefilled once; for each setting StD and vanilla decode the same prompt,
interleaved, `--repeats` times; medians. Prints a Markdown table and writes JSON.
Usage: python benchmarks/std_sweep.py --model models/vidspec-reference --video runtime/ref-long.mp4 \
         --max-frames 512,2048 --budgets 256,512,1024,2048 --gammas 3,5,9
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

from decoders.engine import run
from decoders.model import load_model
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from decoders.video import read_video


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--video", required=True)
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--max-frames", default="512,2048")
    p.add_argument("--budgets", default="256,512,1024,2048")
    p.add_argument("--gammas", default="3,5,9")
    p.add_argument("--refreshes", default="0", help="StD refresh_every values (0: select once per prompt)")
    p.add_argument("--refresh-decay", type=float, default=0.5)
    p.add_argument(
        "--adaptive", action="store_true", help="adaptive gamma (default: fixed, to see each gamma)"
    )
    p.add_argument("--question", default="describe the video .")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/std-sweep.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    prompt = lm.suffix_ids(a.question)
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    rows = []
    for mf in [int(x) for x in a.max_frames.split(",")]:
        sampling = lm.default_sampling(fps=a.fps, max_frames=mf)
        session = VisualSession.create(lm, lm.prepare_video(read_video(a.video, sampling), sampling))
        print(f"{session.num_visual_tokens} visual tokens", file=sys.stderr, flush=True)
        for budget in [int(x) for x in a.budgets.split(",")]:
            for gamma, refresh in itertools.product(
                [int(x) for x in a.gammas.split(",")], [int(x) for x in a.refreshes.split(",")]
            ):
                std_cfg = StDConfig(
                    budget=budget,
                    gamma=gamma,
                    adaptive=a.adaptive,
                    gamma_min=1,
                    gamma_max=max(16, gamma),
                    refresh_every=refresh,
                    refresh_decay=a.refresh_decay,
                )
                v_s, s_s, taus = [], [], []
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    van = run(session, prompt, cfg)
                    std = run(session, prompt, cfg, StDProposer(std_cfg))
                    assert std.tokens == van.tokens, "StD must be lossless"
                    v_s.append(van.stats.decode_s / max(1, van.stats.new_tokens - 1))
                    s_s.append(std.stats.decode_s / max(1, std.stats.new_tokens - 1))
                    taus.append(std.stats.mean_accepted_length or 1.0)
                    st = std.stats
                row = {
                    "visual_tokens": session.num_visual_tokens,
                    "budget": budget,
                    "gamma": gamma,
                    "refresh_every": refresh,
                    "new_tokens": van.stats.new_tokens,
                    "vanilla_s_per_token": statistics.median(v_s),
                    "std_s_per_token": statistics.median(s_s),
                    "speedup": statistics.median(v_s) / statistics.median(s_s),
                    "mean_accepted_length": statistics.median(taus),
                    "acceptance_rate": st.acceptance_rate,
                    "draft_step_s": st.draft_s / max(1, st.num_draft_tokens),
                    "verify_s": st.verify_s / max(1, st.num_steps),
                    "gather_s": st.extra.get("gather_s"),
                }
                rows.append(row)
                print(
                    f"  budget {budget:5d} gamma {gamma:2d} refresh {refresh}: speedup {row['speedup']:.2f}x tau {row['mean_accepted_length']:.2f} "
                    f"accept {row['acceptance_rate'] or 0:.2f} draft {row['draft_step_s'] * 1e3:.2f}ms "
                    f"verify {row['verify_s'] * 1e3:.2f}ms vanilla {row['vanilla_s_per_token'] * 1e3:.2f}ms "
                    f"({time.perf_counter() - t:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        "| visual tokens | budget | gamma | refresh | speedup vs vanilla | mean accepted length | acceptance | draft step ms | verify ms | vanilla step ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['visual_tokens']} | {r['budget']} | {r['gamma']} | {r['refresh_every']} | {r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} "
            f"| {r['acceptance_rate'] or 0:.2f} | {r['draft_step_s'] * 1e3:.2f} | {r['verify_s'] * 1e3:.2f} "
            f"| {r['vanilla_s_per_token'] * 1e3:.2f} |"
        )
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "video": a.video, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
