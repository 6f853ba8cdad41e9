"""Draft-length policies compared without timing noise: real acceptance, a measured cost table.

On a shared 2-core machine the speed of two policies can differ by less than the run-to-run noise. Here each
policy decodes the four caption requests of `vidspec bench` for real (so which drafts are accepted is what the
model does), but the clock is a cost table measured once per length on the same session: v(r), the median
time of a forward + logits of r new rows (r = 1..max), a draft step c (the drafter's own median step time),
and vanilla decoding v(1) per token. A cycle that drafted g tokens costs g * c + v(g + 1). Each policy's
controller is fed those costs instead of its clock, so the comparison is deterministic given the table.
Policies: the adaptive controller (`decoders.gamma`) starting from each gamma in --starts (the default is
6 for both drafters), and every fixed gamma in --fixed, for Sparrow and StD.
Usage: python benchmarks/gamma_policy.py --max-frames 64,192,2048,3200
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

import decoders.proposers.sparrow as sparrow_mod
import decoders.proposers.std as std_mod
from decoders.engine import Verified, run
from decoders.gamma import GammaController
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


def verify_table(session: VisualSession, prompt: list[int], calls: int, rows: int) -> list[float]:
    """[v(1), ..., v(rows)] seconds: median forward + logits time of r new rows, interleaved over r."""
    lm = session.lm
    times: list[list[float]] = [[] for _ in range(rows)]
    with session.prompt():
        session.extend(prompt)
        n = session.length
        for _ in range(calls):
            for r in range(1, rows + 1):
                t = time.perf_counter()
                lm.logits(session.extend(list(range(40, 40 + r)))[0])
                times[r - 1].append(time.perf_counter() - t)
                session.truncate(n)
    return [statistics.median(t) for t in times]


def modelled(table: list[float], step: float) -> type[GammaController]:
    class Modelled(GammaController):
        def update(self, drafted: int, accepted: int, draft_step_s: float, verify_s: float) -> int:
            return super().update(drafted, accepted, step, table[drafted])

    return Modelled


def _logging(observe: Callable[[Verified], None], log: list[int]) -> Callable[[Verified], None]:
    """`observe` that also records each cycle's number of drafted tokens."""

    def wrapped(outcome: Verified) -> None:
        log.append(outcome.drafted)
        observe(outcome)

    return wrapped


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64,192,2048,3200", "benchmarks/results/gamma-policy.json")
    p.add_argument("--fixed", default="2,3,4,5,6,8")
    p.add_argument("--starts", default="6", help="first-cycle gammas of the adaptive controller")
    p.add_argument("--calls", type=int, default=60)
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    cfg = DecodeConfig(max_new_tokens=96)
    prompts = [lm.suffix_ids(q) for q in QUESTIONS]
    fixed = [int(g) for g in a.fixed.split(",")]
    policies = [*(f"adaptive-{g}" for g in a.starts.split(",")), *(f"fixed-{g}" for g in fixed)]
    out = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        table = verify_table(session, prompts[0], a.calls, 1 + max(16, *fixed))  # StD drafts up to 16
        # each drafter's own step time, measured on an untimed run at its default settings
        steps = {}
        for drafter in ("sparrow", "std"):
            times = []
            for q in prompts:
                prop = sparrow_mod.SparrowProposer(head) if drafter == "sparrow" else std_mod.StDProposer()
                st = run(session, q, cfg, prop).stats
                times.append(st.draft_s / max(1, st.num_draft_tokens))
            steps[drafter] = statistics.median(times)
        row = {"visual_tokens": session.num_visual_tokens, "verify_s_by_rows": table, "draft_step_s": steps}
        for drafter in ("sparrow", "std"):
            try:
                for pol in policies:
                    adaptive = pol.startswith("adaptive")
                    g = int(pol.split("-")[1])
                    cls = modelled(table, steps[drafter])
                    sparrow_mod.GammaController = std_mod.GammaController = cls  # type: ignore[misc]
                    session.draft_controllers.clear()  # each policy starts cold, then carries over
                    tokens = 0.0
                    acc = drafts = 0
                    cost = 0.0
                    for q in prompts:
                        if drafter == "sparrow":
                            prop = sparrow_mod.SparrowProposer(head, gamma=g, adaptive=adaptive)
                        else:
                            lo = 2 if adaptive else 1
                            prop = std_mod.StDProposer(
                                std_mod.StDConfig(gamma=g, adaptive=adaptive, gamma_min=lo)
                            )
                        log: list[int] = []
                        prop.observe = _logging(prop.observe, log)  # type: ignore[method-assign]
                        st = run(session, q, cfg, prop).stats
                        tokens += st.new_tokens - 1
                        cost += sum(d * steps[drafter] + table[d] for d in log)
                        acc += st.num_accepted_tokens
                        drafts += st.num_drafts
                    row[f"{drafter}/{pol}"] = {
                        "speedup": round(tokens * table[0] / cost, 3),
                        "mean_accepted_length": round(1 + acc / drafts, 3) if drafts else None,
                    }
            finally:
                sparrow_mod.GammaController = std_mod.GammaController = GammaController  # type: ignore[misc]
        print(row, flush=True)
        out.append(row)
    doc = {"model": a.model, "video": a.video, "threads": a.threads, "blas": cpu_status(), "results": out}
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()  # as `vidspec` does: on AMD CPUs, MKL's fast kernels (infra/cpu.py)
    main()
