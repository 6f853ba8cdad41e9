"""Draft-length policies compared without timing noise: real acceptance, a measured cost model.

On a shared 2-core machine the speed of two policies can differ by less than the run-to-run noise. Here each
policy decodes the four caption requests of `vidspec bench` for real (so which drafts are accepted is what the
model does), but the clock is a cost model measured once per length on the same session: a verify pass of r
rows costs v(r) = v0 + v1 * r (least squares over r = 1..9, medians of many timed forwards), a draft step c
(the proposer's own median step time), and vanilla decoding v(1) per token. Each policy's controller is fed
those modelled costs instead of its clock, so the comparison is deterministic given the model.
Policies: the adaptive controller (`decoders.gamma`) and every fixed gamma in --fixed, for Sparrow and StD.
Usage: python benchmarks/gamma_policy.py --max-frames 64,192,2048,3200
"""

from __future__ import annotations

import json
import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

import decoders.proposers.sparrow as sparrow_mod
import decoders.proposers.std as std_mod
from decoders.engine import run
from decoders.gamma import GammaController
from decoders.model import load_model
from decoders.proposers.router import draft_head
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status

QUESTIONS = (
    "describe the video .",
    "what happens in the video ?",
    "describe what happens .",
    "caption the video .",
)


def verify_cost(session: VisualSession, prompt: list[int], calls: int) -> tuple[float, float]:
    """(v0, v1) seconds: least squares of the median forward + logits time of r rows, r = 1..9."""
    lm = session.lm
    xs, ys = [], []
    with session.prompt():
        session.extend(prompt)
        n = session.length
        for r in range(1, 10):
            ids = list(range(40, 40 + r))
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                lm.logits(session.extend(ids)[0])
                times.append(time.perf_counter() - t)
                session.truncate(n)
            xs.append(r)
            ys.append(statistics.median(times))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    v1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - v1 * mx, v1


def modelled(v0: float, v1: float, step: float) -> type[GammaController]:
    class Modelled(GammaController):
        def update(self, drafted: int, accepted: int, draft_step_s: float, verify_s: float) -> int:
            return super().update(drafted, accepted, step, v0 + v1 * (drafted + 1))

    return Modelled


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64,192,2048,3200", "benchmarks/results/gamma-policy.json")
    p.add_argument("--fixed", default="2,3,4,5,6,8")
    p.add_argument("--calls", type=int, default=60)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device="cpu")
    head = draft_head(lm)
    assert head is not None, "needs the model's Sparrow head"
    cfg = DecodeConfig(max_new_tokens=96)
    prompts = [lm.suffix_ids(q) for q in QUESTIONS]
    policies = ["adaptive", *(f"fixed-{g}" for g in a.fixed.split(","))]
    out = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        v0, v1 = verify_cost(session, prompts[0], a.calls)
        # each drafter's own step time, measured on an untimed run at its default settings
        steps = {}
        for drafter in ("sparrow", "std"):
            times = []
            for q in prompts:
                prop = sparrow_mod.SparrowProposer(head) if drafter == "sparrow" else std_mod.StDProposer()
                st = run(session, q, cfg, prop).stats
                times.append(st.draft_s / max(1, st.num_draft_tokens))
            steps[drafter] = statistics.median(times)
        row = {"visual_tokens": session.num_visual_tokens, "v0_s": v0, "v1_s": v1, "draft_step_s": steps}
        for drafter in ("sparrow", "std"):
            cls = modelled(v0, v1, steps[drafter])
            sparrow_mod.GammaController = std_mod.GammaController = cls  # type: ignore[misc]
            try:
                for pol in policies:
                    adaptive = pol == "adaptive"
                    g = 6 if adaptive else int(pol.split("-")[1])
                    cost = tokens = 0.0
                    acc = drafts = 0
                    for q in prompts:
                        if drafter == "sparrow":
                            prop = sparrow_mod.SparrowProposer(head, gamma=g, adaptive=adaptive)
                        else:
                            lo = 2 if adaptive else 1
                            prop = std_mod.StDProposer(
                                std_mod.StDConfig(gamma=g, adaptive=adaptive, gamma_min=lo)
                            )
                        st = run(session, q, cfg, prop).stats
                        tokens += st.new_tokens - 1
                        cost += st.num_draft_tokens * steps[drafter]
                        cost += st.num_steps * v0 + v1 * (st.num_draft_tokens + st.num_steps)
                        acc += st.num_accepted_tokens
                        drafts += st.num_drafts
                    row[f"{drafter}/{pol}"] = {
                        "speedup": round(tokens * (v0 + v1) / cost, 3),
                        "mean_accepted_length": round(1 + acc / drafts, 3) if drafts else None,
                    }
            finally:
                sparrow_mod.GammaController = std_mod.GammaController = GammaController  # type: ignore[misc]
        print(row, flush=True)
        out.append(row)
    doc = {"model": a.model, "video": a.video, "threads": a.threads, "blas": cpu_status(), "results": out}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
