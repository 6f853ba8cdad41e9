"""Acceptance rules without a model: exact cases, seeded determinism, and the output distribution."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from decoders.accept import greedy_accept, rejection_accept


def _onehot_logits(ids: list[int], vocab: int = 6) -> torch.Tensor:
    x = torch.full((len(ids), vocab), -5.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return x


def test_greedy_accepts_every_matching_draft_and_adds_the_bonus_token() -> None:
    k, tok = greedy_accept(torch.tensor([1, 2, 3]), _onehot_logits([1, 2, 3, 4]))
    assert (k, tok) == (3, 4)


def test_greedy_stops_at_the_first_mismatch_and_recovers_the_target_token() -> None:
    assert greedy_accept(torch.tensor([1, 5, 3]), _onehot_logits([1, 2, 3, 4])) == (1, 2)
    assert greedy_accept(torch.tensor([0, 2, 3]), _onehot_logits([1, 2, 3, 4])) == (0, 1)


def test_greedy_with_no_draft_is_a_plain_argmax() -> None:
    assert greedy_accept(torch.tensor([], dtype=torch.long), _onehot_logits([4])) == (0, 4)


def test_greedy_takes_a_list_of_drafts_as_the_tensor() -> None:
    logits = _onehot_logits([1, 2, 3, 4])
    for draft in ([1, 2, 3], [1, 5, 3], [0, 2, 3], [1, 2, 7]):
        assert greedy_accept(draft, logits) == greedy_accept(torch.tensor(draft), logits)
    assert greedy_accept([], _onehot_logits([4])) == (0, 4)


def test_identical_draft_and_target_distributions_accept_everything() -> None:
    p = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), -1)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        draft = torch.multinomial(p[:3], 1, generator=g).view(-1)
        k, _ = rejection_accept(draft, p[:3], p, g)
        assert k == 3


def test_a_draft_the_target_never_produces_is_always_rejected_and_replaced_from_the_residual() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    outs = [rejection_accept(torch.tensor([0]), q, p, g) for _ in range(200)]
    assert all(k == 0 for k, _ in outs)
    assert {t for _, t in outs} == {1, 2}  # residual max(0, p - q) renormalised


def test_a_deterministic_draft_is_accepted_with_the_target_probability() -> None:
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    g = torch.Generator().manual_seed(0)
    n = 4000
    accepted = sum(rejection_accept(torch.tensor([1]), None, p, g)[0] for _ in range(n))
    assert abs(accepted / n - 0.7) < 0.03
    # when rejected, the replacement is token 0 (the residual of p minus a point mass at 1)
    outs = [rejection_accept(torch.tensor([1]), None, p, g) for _ in range(300)]
    assert all(t == 0 for k, t in outs if k == 0)


def test_rejection_sampling_is_deterministic_for_a_seed() -> None:
    p = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(3)), -1)
    q = torch.softmax(torch.randn(2, 7, generator=torch.Generator().manual_seed(4)), -1)
    d = torch.tensor([1, 2])
    a = [rejection_accept(d, q, p, torch.Generator().manual_seed(9)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def _speculative_chain(
    p_next: np.ndarray, q_next: np.ndarray, n: int, gamma: int, g: torch.Generator
) -> tuple:
    """Generate n tokens of a Markov chain (start state 0) by speculative sampling with draft chain q."""
    out: list[int] = []
    prev = 0
    while len(out) < n:
        draft, qs, s = [], [], prev
        for _ in range(gamma):
            q = torch.tensor(q_next[s])
            s = int(torch.multinomial(q, 1, generator=g))
            draft.append(s)
            qs.append(q)
        ctx = [prev, *draft]
        ps = torch.tensor(np.stack([p_next[c] for c in ctx]))  # [gamma + 1, V]
        k, tok = rejection_accept(torch.tensor(draft), torch.stack(qs), ps, g)
        out += [*draft[:k], tok]
        prev = out[-1]
    return tuple(out[:n])


def test_speculative_sampling_reproduces_the_target_distribution_exactly_enumerated() -> None:
    """Chi-square test of 3-token sequences of a small Markov target against their exact probabilities."""
    rng = np.random.default_rng(0)
    vocab, n, gamma, samples = 3, 3, 2, 6000
    p_next = rng.dirichlet(np.ones(vocab), size=vocab)  # target p(next | prev)
    q_next = rng.dirichlet(np.ones(vocab) * 0.5, size=vocab)  # a different draft
    exact = {
        seq: p_next[0, seq[0]] * p_next[seq[0], seq[1]] * p_next[seq[1], seq[2]]
        for seq in itertools.product(range(vocab), repeat=n)
    }
    g = torch.Generator().manual_seed(0)
    counts: dict[tuple, int] = dict.fromkeys(exact, 0)
    for _ in range(samples):
        counts[_speculative_chain(p_next, q_next, n, gamma, g)] += 1
    chi2 = sum((counts[s] - samples * exact[s]) ** 2 / (samples * exact[s]) for s in exact)
    # 26 degrees of freedom: the 0.999 quantile is 54.05
    assert chi2 < 54.05, chi2
    # and the test has power: the draft chain's own distribution is rejected
    exact_q = {s: q_next[0, s[0]] * q_next[s[0], s[1]] * q_next[s[1], s[2]] for s in exact}
    chi2_q = sum((counts[s] - samples * exact_q[s]) ** 2 / (samples * exact_q[s]) for s in exact)
    assert chi2_q > 54.05
