"""A draft-length model with per-position acceptance rates, replayed on recorded chains (tried, not kept).

`decoders.gamma` models acceptance as geometric: one pooled rate alpha, the first i drafts all accepted with
probability alpha ** i. If acceptance ran in streaks (a later draft likelier to be right once the earlier ones
were), a model with a conditional rate per draft position would draft longer where that pays. Here that model
(each position's decayed accepted / reached counts, shrunk towards the pooled rate with `w` pseudo-observations,
so unexplored positions fall back to the pooled model) is replayed against the shipped controller and every
fixed draft length on the chains and cost tables `benchmarks/draft_stop.py` recorded (no model needed, no
timing noise). Printed per length and drafter: modelled speedup over vanilla (tokens per cycle).
Usage: python benchmarks/gamma_positional.py benchmarks/results/draft-stop-s23.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from draft_stop import replay, replay_adaptive  # benchmarks/ on sys.path (scripts run from there)

from decoders.gamma import GammaController

CHAIN = 10  # draft_stop.py's default chain length: the longest draft a replay can make


@dataclass
class PositionalController(GammaController):
    shrink: float = 3.0  # pseudo-observations of the pooled rate at every position
    _reach: list[float] = field(default_factory=list)  # decayed cycles that reached position i
    _acc: list[float] = field(default_factory=list)  # ... and accepted the draft there

    def update(self, drafted: int, accepted: int, draft_step_s: float, verify_s: float) -> int:
        if drafted > 0:
            if not self._reach:
                self._reach, self._acc = [0.0] * self.gamma_max, [0.0] * self.gamma_max
            self._reach = [x * self.decay for x in self._reach]
            self._acc = [x * self.decay for x in self._acc]
            for i in range(min(accepted + 1, drafted, self.gamma_max)):
                self._reach[i] += 1.0
                self._acc[i] += float(i < accepted)
        return super().update(drafted, accepted, draft_step_s, verify_s)

    def survival(self, g: int) -> list[float]:
        alpha, out, s = self.rate, [], 1.0
        for i in range(g):
            reached = self._reach[i] if i < len(self._reach) else 0.0
            acc = self._acc[i] if i < len(self._acc) else 0.0
            s *= (acc + self.shrink * alpha) / (reached + self.shrink)
            out.append(s)
        return out


def main() -> None:
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    for row in doc["results"]:
        table = row["verify_s_by_rows"]
        for drafter in ("sparrow", "std"):
            data, step = row[drafter]["chains"], row[drafter]["draft_step_s"]
            pooled = replay_adaptive(data, lambda: GammaController(6, 1, CHAIN), table, step)
            line = f"{row['visual_tokens']:>6} {drafter:<8} pooled {pooled[0]:.3f} ({pooled[1]:.2f})"
            for w in (1.0, 3.0, 10.0):
                pos = replay_adaptive(
                    data, lambda w=w: PositionalController(6, 1, CHAIN, shrink=w), table, step
                )
                line += f" | positional w={w:g} {pos[0]:.3f} ({pos[1]:.2f})"
            tokens = sum(len(d) for d in data)
            fixed = {}
            for g in (2, 3, 4, 5, 6, 8, 10):
                reps = [replay(d, lambda conf, g=g: g, table, step) for d in data]
                cost = sum(len(d) / r[0] for d, r in zip(data, reps, strict=True))
                cycles = sum(len(d) / r[1] for d, r in zip(data, reps, strict=True))
                fixed[g] = (tokens / cost, tokens / cycles)
            g, (speed, per_cycle) = max(fixed.items(), key=lambda kv: kv[1][0])
            print(f"{line} | best fixed {g} {speed:.3f} ({per_cycle:.2f})")


if __name__ == "__main__":
    main()
