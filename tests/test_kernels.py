"""The native one-pass attention kernel (decoders.kernels) against torch's two-GEMM attention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoders import attention as A
from decoders import kernels
from decoders.cache import PreallocLayer

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler: the kernel is not built")


def cache_layer(hkv: int, d: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [1, hkv, n, d] as the decode path sees them (keys stored transposed on CPU)."""
    g = torch.Generator().manual_seed(seed)
    layer = PreallocLayer(1, hkv, d, n + 3, torch.float32, torch.device("cpu"))
    return layer.update(torch.randn(1, hkv, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g))


def both(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool) -> tuple:
    """(kernel, torch) outputs of `small_q_attention` for the same inputs."""
    try:
        A.USE_KERNEL = False
        ref = A.small_q_attention(query, keys, values, None, 0.3, causal_tail=causal)
        A.USE_KERNEL = True
        out = A.small_q_attention(query, keys, values, None, 0.3, causal_tail=causal)
    finally:
        A.USE_KERNEL = True
    return out, ref


@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("hkv,group", [(1, 1), (2, 2), (2, 7)])
def test_kernel_matches_torch(d: int, hkv: int, group: int) -> None:
    # lengths around the 256-key blocks and the 16-key vectors; 1 to 17 new rows, causal over the new ones
    for n in (17, 255, 256, 257, 1000, 3001):
        keys, values = cache_layer(hkv, d, n, seed=n)
        for q in (1, 2, 5, 17):
            query = torch.randn(1, hkv * group, q, d, generator=torch.Generator().manual_seed(q))
            out, ref = both(query, keys, values, causal=True)
            assert out.shape == ref.shape == (1, q, hkv * group, d)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kernel_without_causal_tail_and_with_threads() -> None:
    keys, values = cache_layer(2, 32, 2000)
    query = torch.randn(1, 4, 6, 32)
    out, ref = both(query, keys, values, causal=False)  # every row sees every key
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    qg = (query * 0.3).reshape(2, 12, 32).contiguous()
    one = kernels.attention(qg, keys, values, 6, threads=1)
    two = kernels.attention(qg, keys, values, 6, threads=2)
    assert one is not None and two is not None
    assert torch.equal(one, two)  # heads run in parallel; each head's arithmetic is the same


def test_causal_rows_see_only_earlier_new_tokens() -> None:
    # row i of q new tokens must not depend on the keys of new tokens after it
    keys, values = cache_layer(1, 32, 300)
    qg = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
    out = kernels.attention(qg, keys, values, 4)
    keys2, values2 = keys.clone(), values.clone()
    keys2[0, 0, -1] = qg[0, 3]  # the last new key: the one row 3 attends to most
    values2[0, 0, -1] += 3.0
    layer = PreallocLayer(1, 1, 32, 303, torch.float32, torch.device("cpu"))
    keys2, values2 = layer.update(keys2, values2)  # back in the transposed layout
    out2 = kernels.attention(qg, keys2, values2, 4)
    assert out is not None and out2 is not None
    assert torch.equal(out[:, :3], out2[:, :3])
    assert not torch.equal(out[:, 3], out2[:, 3])


def test_unsupported_inputs_fall_back_to_torch() -> None:
    keys, values = cache_layer(2, 32, 500)
    qg = torch.randn(2, 4, 32)
    assert kernels.attention(qg, keys.contiguous(), values, 2) is None  # keys not in the transposed layout
    assert kernels.attention(qg.double(), keys.double(), values.double(), 2) is None
    assert kernels.attention(torch.randn(2, kernels.max_rows() + 2, 32), keys, values, 1) is None
    assert kernels.attention(torch.randn(3, 4, 32), keys, values, 2) is None  # KV heads do not match
    assert kernels.attention(torch.randn(2, 4, 64), keys, values, 2) is None  # head dims do not match
    k48, v48 = cache_layer(2, 48, 500)
    assert kernels.attention(torch.randn(2, 4, 48), k48, v48, 2) is None
    # small_q_attention still answers (torch path) for those
    query = torch.randn(1, 4, 2, 48)
    out = A.small_q_attention(query, k48, v48, None, 0.3, causal_tail=True)
    assert out.shape == (1, 2, 4, 48)


def test_build_is_named_by_source_and_cpu(tmp_path: Path) -> None:
    built = kernels.build(tmp_path / "k.so")
    assert built is not None and built.is_file()
    assert kernels.library_path().name.startswith("vidspec_attn-")


def test_switched_off_by_environment() -> None:
    code = "from decoders import kernels; print(kernels.available())"
    env = {**os.environ, "VIDSPEC_ATTN_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_native_step_matches_the_torch_forward(tiny_models: dict, family: str) -> None:
    from conftest import random_video

    from decoders.session import VisualSession

    lm = tiny_models[family]
    native = lm.fast.native_step()
    assert native is not None
    session = VisualSession.create(lm, lm.prepare_video(random_video(6, 56, 56, seed=2)))
    with torch.inference_mode(), session.prompt():
        session.extend(lm.suffix_ids("what moves ?"))
        n0, pos = session.length, session.length + session.rope_delta
        cache = session.cache
        for tok in (5, 17):
            ids = torch.tensor([[tok]])
            ref = lm.fast.forward(ids, pos, cache)
            k_ref = [layer.keys[:, :, n0].clone() for layer in cache.layers]
            v_ref = [layer.values[:, :, n0].clone() for layer in cache.layers]
            cache.truncate(n0)
            out = native.step(ids, pos, cache)
            assert out is not None and cache.length == n0 + 1
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            for layer, k, v in zip(cache.layers, k_ref, v_ref):
                torch.testing.assert_close(layer.keys[:, :, n0], k, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(layer.values[:, :, n0], v, rtol=1e-4, atol=1e-5)
            cache.truncate(n0)
        # a cache with no room left for the new entry: the caller must fall back
        full = session.cache.gather(
            [torch.zeros(1, lm.num_kv_heads, 4, dtype=torch.long)] * len(cache.layers), 0
        )
        assert native.step(torch.tensor([[5]]), pos, full) is None


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_native_step_of_several_tokens_matches_the_torch_forward(tiny_models: dict, family: str) -> None:
    """n new tokens in one call (causal among themselves), each row as it would be alone."""
    from conftest import random_video

    from decoders.session import VisualSession

    lm = tiny_models[family]
    native = lm.fast.native_step()
    assert native is not None and native.max_rows >= 5
    session = VisualSession.create(lm, lm.prepare_video(random_video(6, 56, 56, seed=3)))
    ids = torch.tensor([[5, 17, 9, 30, 2]])
    with torch.inference_mode(), session.prompt():
        session.extend(lm.suffix_ids("what moves ?"))
        n0, pos = session.length, session.length + session.rope_delta
        cache = session.cache
        ref = lm.fast.forward(ids, pos, cache)
        k_ref = [layer.keys[:, :, n0 : n0 + 5].clone() for layer in cache.layers]
        cache.truncate(n0)
        out = native.step(ids, pos, cache)
        assert out is not None and out.shape == (1, 5, lm.hidden_size) and cache.length == n0 + 5
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for layer, k in zip(cache.layers, k_ref):
            torch.testing.assert_close(layer.keys[:, :, n0 : n0 + 5], k, rtol=1e-4, atol=1e-5)
        cache.truncate(n0)
        one_by_one = []
        for i in range(5):  # row i of the 5-token call against a 1-token call at its position
            one_by_one.append(native.step(ids[:, i : i + 1], pos + i, cache))
        # equal to float noise (the attention kernel tiles 1 and 10 rows differently)
        torch.testing.assert_close(torch.cat(one_by_one, dim=1), out, rtol=1e-5, atol=1e-5)
        cache.truncate(n0)
        assert native.step(torch.zeros(1, native.max_rows + 1, dtype=torch.long), pos, cache) is None


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def test_the_native_forward_stays_lossless(tiny_models: dict, family: str) -> None:
    """`FastDecoder.native_forward` (the default): vanilla, Sparrow and StD answers equal the torch forward's
    vanilla answer, on one thread and on two."""
    from conftest import random_video

    from decoders.engine import run
    from decoders.proposers.sparrow import SparrowProposer, init_head
    from decoders.proposers.std import StDConfig, StDProposer
    from decoders.sampling import DecodeConfig
    from decoders.session import VisualSession

    lm = tiny_models[family]
    session = VisualSession.create(lm, lm.prepare_video(random_video(24, 56, 84, seed=4)))
    prompt = lm.suffix_ids("what moves then leaves ?")
    cfg = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    assert lm.fast.native_forward  # on by default
    head = init_head(lm, seed=1)
    try:
        lm.fast.native_forward = False
        want = run(session, prompt, cfg).tokens
        lm.fast.native_forward = True
        for proposer in (None, SparrowProposer(head, gamma=3), StDProposer(StDConfig(budget=48, gamma=3))):
            assert run(session, prompt, cfg, proposer).tokens == want
        # on two threads (the native stack split between them) every answer is still the same
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            for proposer in (
                None,
                SparrowProposer(head, gamma=3),
                StDProposer(StDConfig(budget=48, gamma=3)),
            ):
                assert run(session, prompt, cfg, proposer).tokens == want
        finally:
            torch.set_num_threads(threads)
    finally:
        lm.fast.native_forward = True


@pytest.mark.parametrize("n", [2, 7, 13])
def test_native_step_rows_do_not_depend_on_how_many_run_together(tiny_models: dict, n: int) -> None:
    """An n-token call (projections in row tiles of 6 / 4 / 2 / 1 over panel-packed weights) gives each row
    what a one-token call gives it: to the last bit for the first row (it sees one entry, so the attention's
    row tiling cannot round differently; the projections sum in one order whatever the tile), to float noise
    for the others (the attention kernel tiles 1 and 2n rows differently)."""
    from decoders.cache import KVCache

    lm = tiny_models["qwen2_vl"]
    native = lm.fast.native_step()
    ids = torch.randint(0, lm.text_config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, 64, torch.float32, "cpu")
    with torch.inference_mode():
        together = native.step(ids, 0, cache)
        cache.truncate(0)
        alone = [native.step(ids[:, i : i + 1], i, cache) for i in range(n)]
    assert together is not None and all(a is not None for a in alone)
    torch.testing.assert_close(torch.cat(alone, dim=1), together, rtol=1e-5, atol=1e-5)
    # the first row sees only itself in both cases: identical to the last bit
    assert torch.equal(alone[0][0, 0], together[0, 0])


@pytest.mark.parametrize("n", [1, 5, 13])
def test_native_step_on_two_threads_is_bit_identical_to_one(tiny_models: dict, n: int) -> None:
    """With threads > 1 the stack splits the projections' columns, the KV heads and the rows among the
    threads: every output, cache entry and recorded attention mass equals the one-thread call's to the
    last bit, on a cache long enough for several key blocks."""
    from decoders.attention import VisualAttentionRecorder
    from decoders.cache import KVCache

    lm = tiny_models["qwen2_vl"]
    native = lm.fast.native_step()
    gen = torch.Generator().manual_seed(10 + n)
    past = 700  # a text history written by the kernel itself, then n new tokens on top
    history = torch.randint(0, lm.text_config.vocab_size, (1, 50), generator=gen)
    ids = torch.randint(0, lm.text_config.vocab_size, (1, n), generator=gen)
    got = []
    for threads in (1, 2):
        cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, past + 64, torch.float32, "cpu")
        with torch.inference_mode():
            for start in range(0, past, 50):
                assert native.step(history, start, cache, 1) is not None
            rec = VisualAttentionRecorder((10, 600))
            out = native.step(ids, past, cache, threads, record=rec)
        assert out is not None
        kv = [
            (layer.keys[:, :, : past + n].clone(), layer.values[:, :, : past + n].clone())
            for layer in cache.layers
        ]
        got.append((out, kv, rec.scores))
    (out1, kv1, mass1), (out2, kv2, mass2) = got
    assert torch.equal(out1, out2)
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(kv1, kv2) for a, b in ((ka, kb), (va, vb)))
    assert sorted(mass1) == sorted(mass2) and all(torch.equal(mass1[i], mass2[i]) for i in mass1)


@pytest.mark.parametrize(
    ("family", "frames"), [("qwen2_vl", 8), ("qwen2_vl", 120), ("qwen2_5_vl", 8), ("llava_onevision", 8)]
)
def test_native_forward_records_the_same_visual_attention_as_the_transformers_forward(
    tiny_models: dict, family: str, frames: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StD's prompt scoring through the native stack (`record=`): each layer's attention mass of the prompt
    rows on the visual span equals what the recording of the transformers forward measures."""
    from conftest import random_video

    from decoders.attention import record_visual_attention
    from decoders.session import VisualSession

    lm = tiny_models[family]
    # 120 frames: 8400 visual entries (the visual span starts at entry 12), over many 256-entry key blocks
    session = VisualSession.create(lm, lm.prepare_video(random_video(frames, 56, 84, seed=5)))
    prompt = lm.suffix_ids("what moves then leaves ?")
    native_step = lm.fast.native_step()
    real, recorded_natively = native_step.step, []

    def spy(*args: object, **kw: object) -> torch.Tensor | None:
        out = real(*args, **kw)
        recorded_natively.append(kw.get("record") is not None and out is not None)
        return out

    recorded = []
    monkeypatch.setattr(native_step, "step", spy)
    try:
        for native in (False, True):
            lm.fast.native_forward = native
            with (
                torch.inference_mode(),
                session.prompt(),
                record_visual_attention(session.visual_span) as rec,
            ):
                hidden = session.extend(prompt)
            recorded.append((rec.scores, hidden))
    finally:
        lm.fast.native_forward = True
    assert recorded_natively == [True]  # the second pass recorded through the native stack, the first did not
    (ref, h_ref), (got, h_got) = recorded
    assert sorted(got) == sorted(ref) == list(range(len(session.cache.layers)))
    torch.testing.assert_close(h_got, h_ref, rtol=1e-4, atol=1e-4)
    for layer in ref:
        assert got[layer].shape == ref[layer].shape
        torch.testing.assert_close(got[layer], ref[layer], rtol=1e-4, atol=1e-5)
