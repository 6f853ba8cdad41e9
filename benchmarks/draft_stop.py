"""When to stop drafting: fixed lengths against a stop on the drafter's own confidence, without timing noise.

For each caption request the vanilla answer T is decoded once. Then, teacher-forced at every position p of T,
the drafter drafts a chain of --chain tokens from the committed prefix T[:p+1] (its state is what any policy
would give it there: both drafters' states depend only on the committed tokens), recording its top-1
probability at every draft position and how many drafts match T. With a cost table measured on the same
session (v(r): forward + logits of r rows; c: the drafter's median step), every policy is then replayed
exactly: a cycle at p drafts g tokens (the policy's choice, possibly decided token by token from the
confidences), accepts min(match(p), g), moves to p + accepted + 1, and costs g * c + v(g + 1).
Policies: fixed g; "conf-t": keep drafting while the product of the top-1 probabilities of the drafts so
far is at least t (the first draft is always made), capped at --chain; "adaptive": the draft-length
controller (`decoders.gamma`, starting at 6, capped at --chain), one controller over the four answers as on
a session; "adaptive-fresh": a fresh controller for every answer (as before controllers were shared). The chains are saved in the JSON, so other controllers can be replayed without the model.
Usage: python benchmarks/draft_stop.py --max-frames 64,192,2048,3200
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch
from gamma_policy import QUESTIONS, verify_table

import decoders.proposers.sparrow as sparrow_mod
import decoders.proposers.std as std_mod
from decoders.engine import Verified, run
from decoders.gamma import GammaController
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status


def chains(
    session: VisualSession, prompt: list[int], answer: list[int], prop: object, chain: int, conf: list[float]
) -> list[tuple[int, list[float]]]:
    """[(matches, top-1 probabilities)] of a `chain`-token draft at every position of `answer`."""
    out = []
    cfg = DecodeConfig(max_new_tokens=len(answer) + chain + 2)
    with torch.inference_mode(), session.prompt():
        prop.prefill(session, prompt, cfg)  # type: ignore[attr-defined]
        for p in range(len(answer) - 1):
            pending = answer[p]
            conf.clear()
            draft = prop.propose(pending, chain)  # type: ignore[attr-defined]
            start = session.length
            hidden = session.extend([pending])  # commit the pending token only (teacher forcing)
            want = answer[p + 1 : p + 1 + chain]
            m = 0
            while m < min(len(want), len(draft.tokens)) and draft.tokens[m] == want[m]:
                m += 1
            out.append((m, list(conf)))
            prop.observe(Verified(start, len(draft.tokens), 0, [pending], answer[p + 1], hidden[0, :1]))  # type: ignore[attr-defined]
    return out


def replay(
    data: list[tuple[int, list[float]]], choose, table: list[float], step: float
) -> tuple[float, float]:
    """(modelled speedup over vanilla, tokens per cycle) of a policy over one answer's chains."""
    p, cost, cycles, n = 0, 0.0, 0, len(data)
    while p < n:
        m, conf = data[p]
        g = max(1, min(choose(conf), n - p))
        k = min(m, g)
        cost += g * step + table[g]
        cycles += 1
        p += k + 1
    return n * table[0] / cost, n / cycles


def replay_adaptive(
    data: list[list[tuple[int, list[float]]]],
    make: Callable[[], GammaController],
    table: list[float],
    step: float,
    shared: bool = True,
) -> tuple[float, float]:
    """`replay` for the draft-length controller: one controller carried over the answers as on a session
    (`shared`), or a fresh one for every answer."""
    c = make()
    total = cost = cycles = 0.0
    for answer in data:
        if not shared:
            c = make()
        p, n = 0, len(answer)
        while p < n:
            g = max(1, min(c.gamma, n - p))
            k = min(answer[p][0], g)
            cost += g * step + table[g]
            cycles += 1
            c.update(g, k, step, table[g])
            p += k + 1
        total += n
    return total * table[0] / cost, total / cycles


def conf_policy(t: float):
    def choose(conf: list[float]) -> int:
        s = 1.0
        for i, c in enumerate(conf):
            s *= c
            if s < t:
                return i + 1
        return len(conf)

    return choose


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64,192,2048,3200", "benchmarks/results/draft-stop.json")
    p.add_argument("--chain", type=int, default=10)
    p.add_argument("--fixed", default="2,3,4,5,6,8")
    p.add_argument("--thresholds", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7")
    p.add_argument("--calls", type=int, default=60)
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    prompts = [lm.suffix_ids(q) for q in QUESTIONS]
    conf: list[float] = []
    for mod in (sparrow_mod, std_mod):
        orig = mod.draft_token

        def recording(logits, cfg, gen, _orig=orig):
            conf.append(float(torch.softmax(logits.float(), -1).max()))
            return _orig(logits, cfg, gen)

        mod.draft_token = recording  # type: ignore[assignment]
    fixed = [int(g) for g in a.fixed.split(",")]
    thresholds = [float(t) for t in a.thresholds.split(",")]
    out = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        table = verify_table(session, prompts[0], a.calls, a.chain + 1)
        answers = [run(session, q, DecodeConfig(max_new_tokens=96)).tokens for q in prompts]
        row: dict = {"visual_tokens": session.num_visual_tokens, "verify_s_by_rows": table}
        for drafter in ("sparrow", "std"):
            data = []
            steps = []
            for q, ans in zip(prompts, answers, strict=True):
                if drafter == "sparrow":
                    prop = sparrow_mod.SparrowProposer(head, gamma=a.chain, adaptive=False)
                else:
                    prop = std_mod.StDProposer(std_mod.StDConfig(gamma=a.chain, adaptive=False, gamma_min=1))
                data.append(chains(session, q, ans, prop, a.chain, conf))
                steps.append(prop.draft_step_s)
            step = statistics.median(steps)
            # calibration: acceptance of draft i given drafts < i accepted, by top-1 probability bin
            bins = [[0, 0] for _ in range(10)]
            for d in data:
                for m, cs in d:
                    for i, c in enumerate(cs[: m + 1]):
                        b = min(9, int(c * 10))
                        bins[b][0] += 1
                        bins[b][1] += int(i < m)
            res: dict = {
                "draft_step_s": step,
                "calibration": [
                    {
                        "top1": f"{b / 10:.1f}-{(b + 1) / 10:.1f}",
                        "n": n,
                        "accepted": round(k / n, 3) if n else None,
                    }
                    for b, (n, k) in enumerate(bins)
                ],
            }
            policies = {f"fixed-{g}": (lambda c, g=g: g) for g in fixed}
            policies.update({f"conf-{t}": conf_policy(t) for t in thresholds})
            for name, choose in policies.items():
                reps = [replay(d, choose, table, step) for d in data]
                tok = sum(len(d) for d in data)
                cyc = sum(len(d) / r[1] for d, r in zip(data, reps, strict=True))
                cost_ratio = sum(len(d) / r[0] for d, r in zip(data, reps, strict=True))
                res[name] = {"speedup": round(tok / cost_ratio, 3), "tokens_per_cycle": round(tok / cyc, 3)}
            ad = replay_adaptive(data, lambda: GammaController(6, 1, a.chain), table, step)
            res["adaptive"] = {"speedup": round(ad[0], 3), "tokens_per_cycle": round(ad[1], 3)}
            ad = replay_adaptive(data, lambda: GammaController(6, 1, a.chain), table, step, shared=False)
            res["adaptive-fresh"] = {"speedup": round(ad[0], 3), "tokens_per_cycle": round(ad[1], 3)}
            res["chains"] = data  # [answer][position] = (matching drafts, top-1 probabilities)
            row[drafter] = res
            print(
                mf, drafter, {k: v for k, v in res.items() if k not in ("calibration", "chains")}, flush=True
            )
            print("  calibration", res["calibration"], flush=True)
        out.append(row)
    doc = {"model": a.model, "video": a.video, "threads": a.threads, "blas": cpu_status(), "results": out}
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()
    main()
