"""Cost-aware draft length: choose gamma to maximise the expected committed tokens per second.

Contract:
- `GammaController(gamma, gamma_min, gamma_max)`; `gamma` is the current choice. After each verification,
  `update(drafted, accepted, draft_step_s, verify_s)` records what happened and re-chooses `gamma`.
- Acceptance model: geometric. Every draft token is accepted, given that the ones before it were, with one
  pooled rate `alpha` = decayed accepted / decayed reached (a cycle that drafted g and accepted k reached
  min(k + 1, g) positions), shrunk towards `prior_rate` with `prior_weight` pseudo-observations; the
  probability that the first i drafts are all accepted is `S(i) = alpha ** i`.
- Cost model: a cycle of gamma g costs `g * c_draft + v0 + v1 * (g + 1)`: c_draft is the decayed mean
  draft-step time; (v0, v1) a decayed least-squares fit of the verify time on the number of verified rows.
  Until two row counts have been seen the slope is 0, so gamma grows, which produces them.
- Expected tokens per cycle `E(g) = 1 + sum_{i<=g} S(i)` (the bonus or recovered token counts);
  the target is `argmax_g E(g) / cost(g)` within [gamma_min, gamma_max]; gamma moves towards it, at most
  `max_step` a cycle.
- One controller serves every prompt of one video and one kind of drafter
  (`VisualSession.draft_controller`): the next answer starts from the rate, costs and gamma the previous
  ones taught it.
Why: the best draft length depends on the hardware as much as on the drafter. On this CPU, verifying
gamma + 1 rows over a long cache costs 2-3x a decode step (attention is compute-bound over many rows), so
long drafts that a GPU would verify for free do not pay; the old rule (grow on full acceptance) ignored it.
Why one pooled rate and not a rate per draft position (the model until 2026-12-03): a per-position rate is
only updated where drafts reach, so a few early rejections at position 3 kept gamma at 2, and at gamma 2
position 3 was never tried again (measured on the reference model: Sparrow's adaptive gamma decoded 15-35%
slower than the best fixed gamma at 0.5k-25k visual tokens). The pooled rate learns from every cycle.
Tried and not kept: hysteresis (move only when the target is expected to be 10% better). On real acceptance
with a measured cost table (`benchmarks/gamma_policy.py`, two videos x 4 lengths x 2 drafters) it changed
the modelled speedup by -6% to +14%, +1.6% on average: no consistent gain.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class GammaController:
    gamma: int
    gamma_min: int = 1
    gamma_max: int = 16
    decay: float = 0.9  # weight of the past per cycle
    max_step: int = 2
    prior_rate: float = 0.7  # acceptance rate assumed before any evidence
    prior_weight: float = 2.0  # ... worth this many draft positions
    reached: float = 0.0  # decayed draft positions the target evaluated
    accepted: float = 0.0  # ... of which accepted
    _draft: tuple[float, float] = (0.0, 0.0)  # decayed (sum of step times, weight)
    _verify: list[float] = field(default_factory=lambda: [0.0] * 5)  # decayed w, n, t, n*n, n*t

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_min <= self.gamma <= self.gamma_max:
            raise ValueError(f"need 1 <= gamma_min <= gamma <= gamma_max, got {self}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        if not 0.0 <= self.prior_rate <= 1.0 or self.prior_weight <= 0:
            raise ValueError("need 0 <= prior_rate <= 1 and prior_weight > 0")

    def update(self, drafted: int, accepted: int, draft_step_s: float, verify_s: float) -> int:
        """Record one cycle (`drafted` tokens, the first `accepted` of them accepted) and re-choose gamma."""
        if drafted <= 0:
            return self.gamma
        d = self.decay
        self.reached = self.reached * d + min(accepted + 1, drafted)
        self.accepted = self.accepted * d + accepted
        s, w = self._draft
        self._draft = (s * d + draft_step_s, w * d + 1.0)
        n = float(drafted + 1)
        self._verify = [x * d for x in self._verify]
        for i, v in enumerate((1.0, n, verify_s, n * n, n * verify_s)):
            self._verify[i] += v
        self.gamma = self.choose()
        return self.gamma

    @property
    def rate(self) -> float:
        """The pooled per-position acceptance rate alpha (shrunk towards the prior)."""
        w = self.prior_weight
        return (self.accepted + self.prior_rate * w) / (self.reached + w)

    def survival(self, g: int) -> list[float]:
        """[S(1), ..., S(g)]: probability that the first i drafts are all accepted (alpha ** i)."""
        a = self.rate
        return [a ** (i + 1) for i in range(g)]

    def verify_cost(self) -> tuple[float, float]:
        """(v0, v1): verify time ~ v0 + v1 * rows, by decayed least squares (slope 0 until identifiable)."""
        w, sn, st, snn, snt = self._verify
        if w <= 0:
            return 0.0, 0.0
        mean_n, mean_t = sn / w, st / w
        var = snn / w - mean_n * mean_n
        slope = max(0.0, (snt / w - mean_n * mean_t) / var) if var > 1e-6 else 0.0
        return max(0.0, mean_t - slope * mean_n), slope

    def choose(self) -> int:
        s, w = self._draft
        c_draft = s / w if w > 0 else 0.0
        v0, v1 = self.verify_cost()
        expected = list(itertools.accumulate(self.survival(self.gamma_max), initial=1.0))  # [g] = E(g)
        rates = {}
        for g in range(self.gamma_min, self.gamma_max + 1):
            cost = g * c_draft + v0 + v1 * (g + 1)
            rates[g] = expected[g] / cost if cost > 0 else float(g)
        best = max(rates, key=lambda g: (rates[g], -g))
        return self.gamma + max(-self.max_step, min(self.max_step, best - self.gamma))
