"""StD: lossless self-speculation over a sparse visual KV cache, on every family."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, assert_sampling_matches_target, make_sessions, random_video

from decoders.attention import record_visual_attention
from decoders.engine import Verified, run
from decoders.model import VideoLM
from decoders.proposers.std import StDConfig, StDProposer, select_top_k, shared_scores
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession

QUESTION = "what moves then leaves ?"
LENGTHS = {"short": (4, 112, 112), "long": (48, 56, 84)}


@pytest.fixture(scope="module")
def sessions(tiny_models: dict) -> dict:
    return make_sessions(tiny_models, LENGTHS, seed=3)


@pytest.mark.parametrize("selection", ["shared", "per_head"])
@pytest.mark.parametrize("budget", [24, 96, 1_000_000])  # tiny, partial, larger than the video
@pytest.mark.parametrize("length", list(LENGTHS))
@pytest.mark.parametrize("family", FAMILIES)
def test_std_greedy_is_token_identical_to_vanilla(
    sessions: dict, family: str, length: str, budget: int, selection: str
) -> None:
    session = sessions[(family, length)]
    prompt = session.lm.suffix_ids(QUESTION)
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    vanilla = run(session, prompt, cfg)
    std = run(session, prompt, cfg, StDProposer(StDConfig(budget=budget, gamma=4, selection=selection)))
    assert std.tokens == vanilla.tokens
    assert std.stats.num_drafts > 0 and session.length == session.prefix_len
    if budget > session.num_visual_tokens + 64:
        # drafting on the whole cache is the target itself: every draft is accepted
        assert std.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_std_greedy_stops_at_eos_like_vanilla(sessions: dict, family: str) -> None:
    session = sessions[(family, "short")]
    prompt = session.lm.suffix_ids("describe the video .")
    cfg = DecodeConfig(max_new_tokens=40)
    assert run(session, prompt, cfg, StDProposer()).tokens == run(session, prompt, cfg).tokens


def test_recorded_attention_equals_eager_attention_weights(tiny_models: dict) -> None:
    """The recorder's per-KV-head visual mass equals the eager attention probabilities of the suffix queries."""
    lm: VideoLM = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(4, 56, 56, seed=1)))
    prompt = lm.suffix_ids(QUESTION)
    vs, ve = session.visual_span
    with session.prompt(), record_visual_attention((vs, ve)) as rec:
        session.extend(prompt)
    lm.model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    try:
        with session.prompt(), torch.inference_mode():
            out = lm.text_model(
                inputs_embeds=lm.embed(torch.tensor([prompt])),
                position_ids=session.positions(session.length, len(prompt)),
                cache=session.cache,
                use_cache=True,
                output_attentions=True,
            )
    finally:
        from decoders.attention import ATTN_NAME

        lm.model.set_attn_implementation({"text_config": ATTN_NAME, "vision_config": "sdpa"})
    group = lm.num_heads // lm.num_kv_heads
    for layer, attn in enumerate(out.attentions):  # [B, Hq, q, kv]
        expected = attn[..., vs:ve].sum(dim=2)  # [B, Hq, n_visual]
        expected = expected.view(1, lm.num_kv_heads, group, -1).sum(dim=2)
        torch.testing.assert_close(rec.scores[layer], expected, rtol=1e-4, atol=1e-5)


def test_select_top_k_keeps_the_highest_scores_per_kv_head_in_cache_order() -> None:
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.8], [0.7, 0.0, 0.6, 0.2]]])
    assert select_top_k(scores, 2, offset=10).tolist() == [[[11, 13], [10, 12]]]
    assert select_top_k(scores, 9, offset=0).shape[-1] == 4  # K larger than the video


def test_shared_scores_pool_normalised_mass_over_layers_and_heads() -> None:
    # layer 0 spreads its mass over entries 0-1, layer 1 puts 10x the mass on entry 3 (normalised away)
    layer0 = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]]])
    layer1 = torch.tensor([[[0.0, 0.0, 0.0, 10.0], [0.0, 0.0, 5.0, 5.0]]])
    shared = shared_scores([layer0, layer1])
    assert shared.shape == (1, 1, 4)
    torch.testing.assert_close(shared, torch.tensor([[[1.1, 0.9, 0.5, 1.5]]]))
    assert select_top_k(shared, 2, offset=0).tolist() == [[[0, 3]]]
    with pytest.raises(ValueError, match="selection"):
        StDConfig(selection="oracle")


def test_the_draft_cache_holds_the_dense_kv_of_committed_tokens(sessions: dict) -> None:
    session = sessions[("qwen2_vl", "long")]
    prompt = session.lm.suffix_ids(QUESTION)
    proposer = StDProposer(StDConfig(budget=64, gamma=3))
    cfg = DecodeConfig(max_new_tokens=12, ignore_eos=True)
    with session.prompt():
        hidden = proposer.prefill(session, prompt, cfg)
        assert hidden.shape[1] == len(prompt)
        start, n0 = session.length, proposer.committed
        draft = proposer.propose(7, 3)
        session.extend([7, *draft.tokens])
        session.truncate(start + 3)  # pretend pending + 2 drafts were accepted
        proposer.observe(Verified(start, 3, 2, [7, *draft.tokens[:2]], 0, hidden[0, :3]))
        assert proposer.committed == n0 + 3
        for layer in range(len(session.cache.layers)):
            dk, dv = session.cache.layer_kv(layer)
            ck, cv = proposer.draft_cache.layer_kv(layer)
            torch.testing.assert_close(ck[:, :, n0 : n0 + 3], dk[:, :, start : start + 3])
            torch.testing.assert_close(cv[:, :, n0 : n0 + 3], dv[:, :, start : start + 3])


def test_adaptive_gamma_follows_acceptance_and_costs(sessions: dict) -> None:
    session = sessions[("qwen2_vl", "short")]
    p = StDProposer(StDConfig(gamma=4, gamma_min=2, gamma_max=8))
    h = torch.zeros(1, 1)
    with session.prompt():
        p.prefill(session, session.lm.suffix_ids(QUESTION), DecodeConfig())
        p.draft_step_s = 0.001
        for _ in range(3):  # full acceptance, verify cost flat in rows: drafts grow
            p.observe(Verified(session.length, p.gamma, p.gamma, [1] * (p.gamma + 1), 0, h, 0.004))
        assert p.gamma > 4
        for _ in range(12):  # every draft rejected at once: drafts shrink to the minimum
            p.observe(Verified(session.length, p.gamma, 0, [1], 0, h, 0.004))
        assert p.gamma == 2
    fixed = StDProposer(StDConfig(gamma=4, adaptive=False))
    with session.prompt():
        fixed.prefill(session, session.lm.suffix_ids(QUESTION), DecodeConfig())
        fixed.observe(Verified(session.length, 4, 4, [1] * 5, 0, torch.zeros(1, 1), 0.004))
    assert fixed.gamma == 4


def test_std_sampling_reproduces_the_target_distribution(sessions: dict) -> None:
    """Every speculatively sampled token, given its prefix, must follow the target's distribution.

    For each sampled token we compute the exact target distribution given the tokens before it (a dense
    forward pass) and its randomised probability integral transform, which is Uniform(0, 1) exactly when
    the sampler is right; a Kolmogorov-Smirnov test checks that at the 0.001 level."""
    session = sessions[("qwen2_vl", "long")]
    assert_sampling_matches_target(
        session, lambda: StDProposer(StDConfig(budget=48, gamma=3, adaptive=False)), QUESTION
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_std_with_refresh_is_token_identical_to_vanilla(sessions: dict, family: str) -> None:
    session = sessions[(family, "long")]
    prompt = session.lm.suffix_ids(QUESTION)
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    p = StDProposer(StDConfig(budget=48, gamma=3, refresh_every=1, refresh_decay=0.5))
    std = run(session, prompt, cfg, p)
    assert std.tokens == run(session, prompt, cfg).tokens
    assert p.k_visual > 0 and std.stats.extra["refreshes"] == std.stats.num_drafts > 0
    assert session.length == session.prefix_len


def test_the_verify_watch_sees_each_querys_eager_attention(tiny_models: dict) -> None:
    """What the lean path reports for a 3-token step equals the eager attention of each of its queries."""
    from decoders.attention import ATTN_NAME, VisualAttentionRecorder, watch_visual_attention

    lm: VideoLM = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(16, 56, 84, seed=1)))
    assert session.num_visual_tokens >= 256  # the lean attention path (long cache)
    prompt = lm.suffix_ids(QUESTION)
    vs, ve = session.visual_span
    step = [7, 8, 9]
    with session.prompt():
        session.extend(prompt)
        rec = VisualAttentionRecorder(span=(vs, ve))
        with watch_visual_attention(rec):
            session.extend(step)
    lm.model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    try:
        with session.prompt(), torch.inference_mode():
            session.extend(prompt)
            out = lm.text_model(
                inputs_embeds=lm.embed(torch.tensor([step])),
                position_ids=session.positions(session.length, len(step)),
                cache=session.cache,
                use_cache=True,
                output_attentions=True,
            )
    finally:
        lm.model.set_attn_implementation({"text_config": ATTN_NAME, "vision_config": "sdpa"})
    group = lm.num_heads // lm.num_kv_heads
    assert sorted(rec.scores) == list(range(lm.num_layers))
    for layer, attn in enumerate(out.attentions):  # [B, Hq, q, kv]
        expected = attn[:, :, :, vs:ve].view(1, lm.num_kv_heads, group, len(step), -1).sum(dim=2)
        torch.testing.assert_close(rec.scores[layer], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("selection", ["shared", "per_head"])
def test_a_refresh_regathers_the_top_k_of_the_updated_scores(sessions: dict, selection: str) -> None:
    session = sessions[("qwen2_vl", "long")]
    prompt = session.lm.suffix_ids(QUESTION)
    p = StDProposer(StDConfig(budget=40, gamma=3, refresh_every=2, refresh_decay=0.5, selection=selection))
    cfg = DecodeConfig(max_new_tokens=12, ignore_eos=True)
    vs, ve = session.visual_span
    with session.prompt():
        hidden = p.prefill(session, prompt, cfg)
        before = [s.clone() for s in p.scores]
        for cycle in range(2):
            start = session.length
            draft = p.propose(7, 3)
            with p.verify_watch():
                session.extend([7, *draft.tokens])
            session.truncate(start + 2)  # pending + 1 accepted draft
            rows = {layer: m.clone() for layer, m in p.watch.scores.items()}  # [B, Hkv, q, n_visual]
            prev = [s.clone() for s in p.scores]
            p.observe(Verified(start, 3, 1, [7, draft.tokens[0]], 0, hidden[0, :2]))
            assert p.info["refreshes"] == cycle  # the second cycle re-gathers
            for layer, mass in rows.items():  # decayed, plus the rows of the two committed tokens only
                assert mass.shape[2] == 1 + len(draft.tokens)
                torch.testing.assert_close(p.scores[layer], prev[layer] * 0.5 + mass[:, :, :2].sum(dim=2))
        assert any(not torch.equal(a, b) for a, b in zip(before, p.scores))
        # the draft cache: system turn, the top-K of the new scores, then every committed text entry
        n_before, k = vs, p.k_visual
        assert p.committed == n_before + k + (session.length - ve)
        for layer in range(len(session.cache.layers)):
            if selection == "shared":  # one top-K for every layer and KV head
                hkv = p.scores[layer].shape[1]
                want = select_top_k(shared_scores(p.scores), k, vs).expand(-1, hkv, -1)
            else:
                want = select_top_k(p.scores[layer], k, vs)  # [B, Hkv, k]
            dk, _ = session.cache.layer_kv(layer)
            ck, _ = p.draft_cache.layer_kv(layer)
            got = ck[:, :, n_before : n_before + k]
            torch.testing.assert_close(
                got, torch.gather(dk, 2, want[..., None].expand(*want.shape, dk.shape[-1]))
            )
            torch.testing.assert_close(ck[:, :, n_before + k : p.committed], dk[:, :, ve : session.length])


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_draft_runs_the_draft_steps_through_the_compiled_forward(
    sessions: dict, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = sessions[(family, "long")]
    fast = session.lm.fast
    assert fast is not None
    calls = []

    def counted(*args: object) -> torch.Tensor:  # stands in for torch.compile's output (same function)
        calls.append(1)
        return fast.forward(*args)

    monkeypatch.setattr(fast, "_compiled", counted)
    prompt = session.lm.suffix_ids(QUESTION)
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    std = run(session, prompt, cfg, StDProposer(StDConfig(budget=48, gamma=3, compile_draft=True)))
    assert std.tokens == run(session, prompt, cfg).tokens
    assert len(calls) == std.stats.num_draft_tokens > 0


@pytest.mark.slow
def test_std_with_a_really_compiled_draft_is_token_identical_to_vanilla(sessions: dict) -> None:
    session = sessions[("qwen2_vl", "long")]
    prompt = session.lm.suffix_ids(QUESTION)
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    std = run(session, prompt, cfg, StDProposer(StDConfig(budget=48, gamma=3, compile_draft=True)))
    assert std.tokens == run(session, prompt, cfg).tokens and std.stats.num_drafts > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_native_draft_runs_the_draft_steps_natively_and_stays_lossless(
    sessions: dict, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = sessions[(family, "long")]
    native = session.lm.fast.native_step()
    if native is None:
        pytest.skip("no native step here (no C++ compiler)")
    calls = []
    real = native.step

    def counted(*args: object, **kw: object) -> torch.Tensor | None:
        out = real(*args, **kw)
        if args[2] is not session.cache:  # a draft step (vanilla steps and verify passes use the dense cache)
            calls.append(out is not None)
        return out

    monkeypatch.setattr(native, "step", counted)
    prompt = session.lm.suffix_ids(QUESTION)
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    std = run(session, prompt, cfg, StDProposer(StDConfig(budget=48, gamma=3)))
    assert std.tokens == run(session, prompt, cfg).tokens
    assert len(calls) == std.stats.num_draft_tokens > 0 and all(calls)  # every draft step ran natively
    calls.clear()
    monkeypatch.setattr(session.lm.fast, "native_forward", False)  # else the draft's forward is native too
    torch_draft = run(session, prompt, cfg, StDProposer(StDConfig(budget=48, gamma=3, native_draft=False)))
    assert torch_draft.tokens == std.tokens and not calls
