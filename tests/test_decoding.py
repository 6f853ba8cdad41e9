"""Vanilla decoding on the preallocated cache against the oracle and against `generate`, for every family."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, random_video

from decoders.engine import SpecDecodeStats, generate, run
from decoders.model import Family, VideoLM
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession

QUESTION = "what moves then leaves ?"
# (frames, height, width): "short" keeps the temporal groups within max(h, w) / merge (where transformers'
# own position rule agrees with Qwen's); "long" has many more temporal groups than that.
LENGTHS = {"short": (4, 112, 112), "long": (48, 56, 84)}


def reference_positions(
    ids: list[int], video_id: int, grid: tuple[int, int, int], interval: float
) -> torch.Tensor:
    """The original Qwen mRoPE rule, written out independently of decoders/: text tokens advance one by one;
    vision tokens take (start + floor(t * interval), start + row, start + col); text after the vision block
    starts at the largest vision position + 1."""
    t, h, w = grid[0], grid[1] // 2, grid[2] // 2
    out: list[tuple[int, int, int]] = []
    nxt = 0
    i = 0
    while i < len(ids):
        if ids[i] != video_id:
            out.append((nxt, nxt, nxt))
            nxt += 1
            i += 1
            continue
        start = nxt
        block = [
            (start + int(ti * interval), start + r, start + c)
            for ti in range(t)
            for r in range(h)
            for c in range(w)
        ]
        out += block
        i += len(block)
        nxt = max(max(p) for p in block) + 1
    return torch.tensor(out).T.unsqueeze(1)  # [3, 1, L]


def oracle_greedy(lm: VideoLM, video: object, prompt: list[int], max_new: int) -> list[int]:
    """Step-by-step argmax of full forward passes without a cache, with explicit correct positions."""
    visual = lm.prepare_video(video)
    prefix = lm.prefix_ids(visual.num_tokens).ids
    ids = prefix + prompt
    out: list[int] = []
    for _ in range(max_new):
        x = torch.tensor([ids])
        with torch.inference_mode():
            if lm.family.is_qwen:
                interval = 1.0
                kw: dict = {}
                if lm.family is Family.QWEN2_5_VL:
                    interval = 2 * visual.second_per_grid_t
                    kw["second_per_grid_ts"] = torch.tensor([visual.second_per_grid_t])
                logits = lm.model(
                    input_ids=x,
                    pixel_values_videos=visual.pixel_values,
                    video_grid_thw=torch.tensor([visual.grid_thw]),
                    mm_token_type_ids=(x == lm.video_token_id).long() * 2,
                    position_ids=reference_positions(ids, lm.video_token_id, visual.grid_thw, interval),
                    **kw,
                ).logits
            else:
                logits = lm.model(
                    input_ids=x,
                    pixel_values_videos=visual.pixel_values,
                    position_ids=torch.arange(len(ids)).view(1, -1),
                ).logits
        tok = int(torch.argmax(logits[0, -1]))
        out.append(tok)
        ids.append(tok)
        if tok in lm.eos_token_ids:
            break
    return out


def vanilla(lm: VideoLM, video: object, prompt: list[int], max_new: int) -> list[int]:
    session = VisualSession.create(lm, lm.prepare_video(video))
    return run(session, prompt, DecodeConfig(max_new_tokens=max_new)).tokens


@pytest.mark.parametrize("length", list(LENGTHS))
@pytest.mark.parametrize("family", FAMILIES)
def test_vanilla_greedy_is_token_identical_to_the_oracle(tiny_models: dict, family: str, length: str) -> None:
    lm = tiny_models[family]
    video = random_video(*LENGTHS[length], seed=3)
    prompt = lm.suffix_ids(QUESTION)
    expected = oracle_greedy(lm, video, prompt, 16)
    assert len(set(expected)) > 2, "the tiny model should not just repeat one token"
    assert vanilla(lm, video, prompt, 16) == expected


def test_the_long_video_is_long_enough_to_hit_the_position_rule(tiny_models: dict) -> None:
    """transformers 5.24's get_rope_index ignores the temporal extent of a video: for the 'long' video
    its text positions differ from the Qwen rule, for the 'short' one they agree."""
    lm = tiny_models["qwen2_vl"]
    for length, should_agree in (("short", True), ("long", False)):
        visual = lm.prepare_video(random_video(*LENGTHS[length]))
        ids = lm.prefix_ids(visual.num_tokens).ids + lm.suffix_ids(QUESTION)
        x = torch.tensor([ids])
        hf_pos, _ = lm.model.model.get_rope_index(
            x,
            mm_token_type_ids=(x == lm.video_token_id).long() * 2,
            video_grid_thw=torch.tensor([visual.grid_thw]),
        )
        ours = reference_positions(ids, lm.video_token_id, visual.grid_thw, 1.0)
        assert torch.equal(hf_pos, ours) == should_agree


@pytest.mark.parametrize("family", FAMILIES)
def test_vanilla_greedy_equals_generate_where_generate_is_consistent(tiny_models: dict, family: str) -> None:
    lm = tiny_models[family]
    video = random_video(*LENGTHS["short"], seed=5)
    visual = lm.prepare_video(video)
    prompt = lm.suffix_ids(QUESTION)
    ids = torch.tensor([lm.prefix_ids(visual.num_tokens).ids + prompt])
    kw: dict = {"pixel_values_videos": visual.pixel_values}
    if lm.family.is_qwen:
        kw["video_grid_thw"] = torch.tensor([visual.grid_thw])
        kw["mm_token_type_ids"] = (ids == lm.video_token_id).long() * 2
        if visual.second_per_grid_t is not None:
            kw["second_per_grid_ts"] = torch.tensor([visual.second_per_grid_t])
    out = lm.model.generate(
        input_ids=ids, max_new_tokens=16, do_sample=False, eos_token_id=list(lm.eos_token_ids), **kw
    )
    expected = out[0, ids.shape[1] :].tolist()
    assert vanilla(lm, video, prompt, 16) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_a_session_answers_two_prompts_like_two_fresh_prefills(tiny_models: dict, family: str) -> None:
    lm = tiny_models[family]
    video = random_video(6, 56, 56, seed=9)
    q1, q2 = lm.suffix_ids("what colour is the circle ?"), lm.suffix_ids("describe the video .")
    session = VisualSession.create(lm, lm.prepare_video(video))
    cfg = DecodeConfig(max_new_tokens=12)
    a1, a2 = run(session, q1, cfg).tokens, run(session, q2, cfg).tokens
    assert session.length == session.prefix_len
    assert a1 == vanilla(lm, video, q1, 12)
    assert a2 == vanilla(lm, video, q2, 12)
    assert run(session, q1, cfg).tokens == a1


def test_stopping_early_leaves_the_session_at_its_prefix(tiny_models: dict) -> None:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(4, 56, 56)))
    gen = generate(session, lm.suffix_ids(QUESTION), DecodeConfig(max_new_tokens=10))
    next(gen)
    next(gen)
    assert session.length > session.prefix_len
    gen.close()
    assert session.length == session.prefix_len


def test_max_new_tokens_and_eos_bound_the_output(tiny_models: dict) -> None:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(4, 56, 56)))
    stats = SpecDecodeStats()
    tokens = [
        t
        for c in generate(session, lm.suffix_ids(QUESTION), DecodeConfig(max_new_tokens=5), None, stats)
        for t in c
    ]
    assert len(tokens) <= 5 and stats.new_tokens == len(tokens)
    assert all(t not in lm.eos_token_ids for t in tokens[:-1])
    # any id in the EOS list stops generation, and the EOS itself is emitted
    free = run(session, lm.suffix_ids(QUESTION), DecodeConfig(max_new_tokens=20)).tokens
    saved = lm.eos_token_ids
    lm.eos_token_ids = (*saved, free[3])
    try:
        out = run(session, lm.suffix_ids(QUESTION), DecodeConfig(max_new_tokens=20)).tokens
    finally:
        lm.eos_token_ids = saved
    assert out == free[: free.index(free[3]) + 1]


def test_sampling_is_reproducible_by_seed_and_differs_across_seeds(tiny_models: dict) -> None:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(4, 56, 56)))
    prompt = lm.suffix_ids(QUESTION)

    def sample(seed: int) -> list[int]:
        return run(
            session, prompt, DecodeConfig(max_new_tokens=24, temperature=1.5, top_p=0.95, seed=seed)
        ).tokens

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


def test_decode_config_rejects_bad_values() -> None:
    for kw in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            DecodeConfig(**kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_lean_decode_path_computes_what_transformers_computes(tiny_models: dict, family: str) -> None:
    """FastDecoder (fused QKV, 1-D RoPE for text) vs the transformers stack, on the same cache state."""
    lm = tiny_models[family]
    assert lm.fast is not None
    session = VisualSession.create(lm, lm.prepare_video(random_video(8, 56, 84, seed=1)))
    ids = torch.tensor([lm.suffix_ids(QUESTION)])
    n = ids.shape[1]
    with session.prompt(), torch.inference_mode():
        ref = lm.forward(session.positions(session.length, n), session.cache, input_ids=ids)
        ref_k = session.cache.layer_kv(0)[0][:, :, -n:].clone()
    with session.prompt(), torch.inference_mode():
        got = lm.fast.forward(ids, session.length + session.rope_delta, session.cache)
        got_k = session.cache.layer_kv(0)[0][:, :, -n:].clone()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden", [128, 896, 3584])
def test_the_lean_norm_and_rope_are_bitwise_the_stock_ones(hidden: int) -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    from decoders.fastpath import rms_norm, rope_signed

    torch.manual_seed(hidden)
    norm = Qwen2RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(1, 10, hidden) * 3
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    q, k = torch.randn(1, 4, 10, 64), torch.randn(1, 2, 10, 64)
    freqs = torch.randn(10, 32)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    signed = torch.cat([-freqs.sin(), freqs.sin()], -1)
    assert torch.equal(rope_signed(q, cos, signed), ref_q)
    assert torch.equal(rope_signed(k, cos, signed), ref_k)


class _Oracle:
    """Drafts the target's own greedy continuation (known in advance): every draft is accepted."""

    name = "oracle"

    def __init__(self, continuation: list[int]) -> None:
        self.cont, self.i = continuation, 0

    def prefill(self, session: VisualSession, prompt_ids: list[int], cfg: DecodeConfig) -> torch.Tensor:
        return session.extend(prompt_ids)

    def propose(self, pending: int, max_tokens: int) -> object:
        from decoders.engine import Draft

        return Draft(self.cont[self.i + 1 : self.i + 1 + min(6, max_tokens)])

    def observe(self, outcome: object) -> None:
        self.i += outcome.accepted + 1


def test_drafts_accepted_after_an_eos_are_not_counted(tiny_models: dict, monkeypatch) -> None:
    lm = tiny_models["qwen2_vl"]
    session = VisualSession.create(lm, lm.prepare_video(random_video(8, 56, 84, seed=3)))
    prompt = lm.suffix_ids(QUESTION)
    cont = run(session, prompt, DecodeConfig(max_new_tokens=12, ignore_eos=True)).tokens
    stop = next(i for i in range(2, 7) if cont[i] not in cont[:i])  # first appears at i, among the drafts
    monkeypatch.setattr(lm, "eos_token_ids", (cont[stop],))
    got = run(session, prompt, DecodeConfig(max_new_tokens=12), _Oracle(cont))
    assert got.tokens == cont[: stop + 1]
    # one cycle drafted 6 tokens, all matching the target, but only the drafts up to the EOS were emitted
    assert got.stats.num_drafts == 1 and got.stats.num_draft_tokens == 6
    assert got.stats.num_accepted_tokens == stop
    assert got.stats.mean_accepted_length == 1 + stop
