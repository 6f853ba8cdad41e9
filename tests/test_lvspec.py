"""LVSpec: the loose rule and the relevance score on hand-built tensors; lam = 0 is lossless."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, random_video

from decoders.accept import greedy_accept, loose_accept
from decoders.engine import run
from decoders.proposers.lvspec import LVSpecProposer, relevance_scores
from decoders.proposers.sparrow import SparrowProposer, init_head
from decoders.proposers.std import StDConfig, StDProposer
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession

V = 6


def _logits(rows: list[dict[int, float]]) -> torch.Tensor:
    """Target logits from per-position probabilities {token: p} (the rest share what is left)."""
    out = []
    for row in rows:
        p = torch.full((V,), (1.0 - sum(row.values())) / (V - len(row)))
        for t, v in row.items():
            p[t] = v
        out.append(torch.log(p))
    return torch.stack(out)


# target: position 0 prefers 1 (0.6) over 2 (0.3); position 1 prefers 3; position 2 prefers 4
TARGET = _logits([{1: 0.6, 2: 0.3}, {3: 0.7}, {4: 0.7}])


def test_an_anchor_that_differs_from_the_target_is_rejected() -> None:
    k, tok = loose_accept(torch.tensor([2, 3]), TARGET, torch.tensor([0.9, 0.0]), 0.5, lam=0.9)
    assert (k, tok) == (0, 1)


def test_a_plausible_filler_is_accepted_and_an_implausible_one_is_not() -> None:
    # p(2) = 0.3 >= (1 - 0.6) * 0.6 = 0.24: accepted; then 3 matches; bonus 4
    assert loose_accept(torch.tensor([2, 3]), TARGET, torch.tensor([0.1, 0.1]), 0.5, lam=0.6) == (2, 4)
    # lam = 0.4: needs p >= 0.36: rejected
    assert loose_accept(torch.tensor([2, 3]), TARGET, torch.tensor([0.1, 0.1]), 0.5, lam=0.4) == (0, 1)


def test_a_shifted_token_is_accepted_inside_the_window_and_rejected_outside() -> None:
    # the draft says 3 at position 0; the target produces 3 at position 1
    rel = torch.tensor([0.9, 0.9])  # anchors: only exact/shifted matches count
    assert loose_accept(torch.tensor([3, 3]), TARGET, rel, 0.5, lam=0.0, shift_window=1)[0] >= 1
    assert loose_accept(torch.tensor([3, 3]), TARGET, rel, 0.5, lam=0.0, shift_window=0) == (0, 1)
    # 4 is produced at position 2: two places from position 0
    assert loose_accept(torch.tensor([4]), TARGET[:2], torch.tensor([0.9]), 0.5, lam=0.0, shift_window=1) == (
        0,
        1,
    )


def test_lam_zero_without_a_window_is_exact_match() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(5, V, generator=g)
        draft = torch.randint(0, V, (4,), generator=g)
        rel = torch.rand(4, generator=g)
        assert loose_accept(draft, logits, rel, 0.5, lam=0.0) == greedy_accept(draft, logits)


def test_relevance_is_the_mean_of_the_top_n_cosines() -> None:
    vis = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), dim=-1)
    tok = torch.tensor([[2.0, 0.0], [0.0, -1.0]])
    got = relevance_scores(tok, vis, top_n=2)
    c = 2**-0.5
    assert torch.allclose(got, torch.tensor([(1.0 + c) / 2, (0.0 + -c) / 2]), atol=1e-6)
    assert relevance_scores(tok, vis, top_n=50).shape == (2,)  # N larger than the video


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("base", ["std", "sparrow"])
@pytest.mark.parametrize("representation", ["input", "final"])
def test_lam_zero_and_no_window_is_token_identical_to_vanilla(
    tiny_models: dict, family: str, base: str, representation: str
) -> None:
    lm = tiny_models[family]
    session = VisualSession.create(lm, lm.prepare_video(random_video(16, 56, 84, seed=2)))
    prompt = lm.suffix_ids("what colour is the circle ?")
    cfg = DecodeConfig(max_new_tokens=20, ignore_eos=True)
    inner = (
        StDProposer(StDConfig(budget=48, gamma=4))
        if base == "std"
        else SparrowProposer(init_head(lm), gamma=4)
    )
    p = LVSpecProposer(inner, lam=0.0, shift_window=0, relevance_threshold=0.3, representation=representation)
    got = run(session, prompt, cfg, p)
    assert got.tokens == run(session, prompt, cfg).tokens
    assert got.stats.method == f"lvspec:{base}" and got.stats.extra["lossy"] is True


def test_loose_settings_accept_more_than_exact_match(tiny_models: dict) -> None:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(16, 56, 84, seed=2)))
    prompt = lm.suffix_ids("describe the video .")
    cfg = DecodeConfig(max_new_tokens=30, ignore_eos=True)

    def accepted(lam: float, window: int) -> float:
        inner = StDProposer(StDConfig(budget=32, gamma=4, adaptive=False))
        res = run(
            session, prompt, cfg, LVSpecProposer(inner, lam=lam, shift_window=window, relevance_threshold=1.1)
        )
        return res.stats.acceptance_rate or 0.0

    assert accepted(0.9, 1) > accepted(0.0, 0)


def test_lvspec_refuses_sampling(tiny_models: dict) -> None:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(4, 56, 56)))
    with pytest.raises(ValueError, match="greedy"):
        run(session, lm.suffix_ids("x"), DecodeConfig(temperature=1.0), LVSpecProposer(StDProposer()))
