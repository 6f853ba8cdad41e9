"""Unit tests of the cost-aware draft length (pure logic)."""

from __future__ import annotations

import itertools
import random

import pytest

from decoders.gamma import GammaController


def feed(c: GammaController, cycles: int, accept: int, step_s: float, verify: tuple[float, float]) -> None:
    """`cycles` cycles where min(accept, gamma) drafts are accepted; verify = v0 + v1 * rows."""
    for _ in range(cycles):
        g = c.gamma
        c.update(g, min(accept, g), step_s, verify[0] + verify[1] * (g + 1))


def test_survival_is_a_decreasing_product_of_rates() -> None:
    c = GammaController(gamma=4, gamma_max=8)
    c.update(4, 2, 0.001, 0.01)  # accepted at 1, 2; rejected at 3
    s = c.survival(6)
    assert all(a >= b for a, b in itertools.pairwise(s))
    assert s[0] > s[2]  # position 3 was a rejection
    assert 0.0 < s[-1] < 1.0


def test_full_acceptance_with_flat_verify_cost_grows_to_the_maximum() -> None:
    c = GammaController(gamma=3, gamma_max=10)
    feed(c, 30, accept=100, step_s=0.001, verify=(0.005, 0.0))
    assert c.gamma == 10


def test_early_rejection_shrinks_to_the_minimum() -> None:
    c = GammaController(gamma=8, gamma_min=2, gamma_max=10)
    feed(c, 30, accept=0, step_s=0.001, verify=(0.005, 0.0))
    assert c.gamma == 2


def draw(rng: random.Random, gamma: int, p: float) -> int:
    """Accepted drafts of a cycle when each is accepted independently with probability p."""
    k = 0
    while k < gamma and rng.random() < p:
        k += 1
    return k


def run_iid(verify_slope: float, seed: int = 0) -> tuple[float, GammaController]:
    """Drafts accepted independently with probability 0.9; draft step 0.5 ms, verify 6 ms + slope per row.
    Returns the mean gamma over the last 150 of 300 cycles."""
    rng = random.Random(seed)
    c = GammaController(gamma=4, gamma_max=16)
    chosen = []
    for _ in range(300):
        g = c.gamma
        chosen.append(g)
        c.update(g, draw(rng, g, 0.9), 0.0005, 0.006 + verify_slope * (g + 1))
    return sum(chosen[150:]) / 150, c


def test_expensive_verify_rows_give_shorter_drafts() -> None:
    """Expected tokens per second peak near gamma 10-11 with a flat verify and near 4 when each verified row
    costs 3 ms (as on a CPU at long lengths): the controller must land near each optimum."""
    flat, _ = run_iid(0.0)
    dear, c = run_iid(0.003)
    assert flat >= 8.0, flat
    assert dear <= 6.0, dear
    v0, v1 = c.verify_cost()
    assert v1 == pytest.approx(0.003, rel=0.05)
    assert v0 == pytest.approx(0.006, rel=0.05)


def test_early_rejections_do_not_trap_it_at_short_drafts() -> None:
    """Three early cycles rejected at position 3, then drafts accepted independently with probability 0.9 and
    a flat verify cost: every cycle is evidence about the acceptance rate, so gamma climbs back (a rate per
    position was only updated where drafts reached, and stayed at 2 here)."""
    c = GammaController(gamma=6, gamma_max=12)
    for _ in range(3):
        c.update(c.gamma, min(2, c.gamma), 0.0002, 0.002)
    assert c.gamma <= 4
    rng = random.Random(1)
    chosen = []
    for _ in range(60):
        g = c.gamma
        chosen.append(g)
        c.update(g, draw(rng, g, 0.9), 0.0002, 0.002)
    assert sum(chosen[-20:]) / 20 >= 6.5, chosen  # the optimum is about 10 (flat from 8 to 12)
    assert c.rate == pytest.approx(0.9, abs=0.08)


def test_rate_pools_every_reached_position() -> None:
    c = GammaController(gamma=4, decay=1.0, prior_weight=1e-9)
    c.update(4, 4, 0.001, 0.01)  # 4 reached, 4 accepted
    c.update(4, 1, 0.001, 0.01)  # 2 reached (1 accepted, then the rejection), 1 accepted
    assert c.rate == pytest.approx(5 / 6)
    assert c.survival(3) == pytest.approx([5 / 6, (5 / 6) ** 2, (5 / 6) ** 3])


def test_moves_towards_the_best_gamma_of_the_whole_range() -> None:
    """Acceptance 0.8 per draft, draft step 0.2 ms, verify 2 ms flat: tokens per ms peak at gamma 6."""

    def choice(start: int) -> int:
        c = GammaController(gamma=start, gamma_max=10, decay=1.0, prior_weight=1e-9)
        c.reached, c.accepted = 1000.0, 800.0
        c._draft = (0.0002, 1.0)
        c._verify = [2.0, 2.0 * 5, 2.0 * 0.002, 2.0 * 25, 2.0 * 5 * 0.002]  # rows 5, 2 ms
        return c.choose()

    assert [choice(g) for g in (1, 3, 5, 6, 7, 10)] == [3, 5, 6, 6, 6, 8]  # at most two steps a cycle


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        GammaController(gamma=5, gamma_min=6)
    with pytest.raises(ValueError):
        GammaController(gamma=1, decay=0.0)
