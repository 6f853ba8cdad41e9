"""The few-query attention path: its scratch-buffer, in-place form computes exactly what the allocating one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decoders import attention as A


@pytest.fixture
def allocating() -> object:
    yield
    A.REUSE_SCORES = True


@pytest.mark.parametrize("kv", [40, 700, 5000])
@pytest.mark.parametrize("q", [1, 3, 8])
def test_in_place_scores_are_bitwise_the_allocating_path(kv: int, q: int, allocating: object) -> None:
    g = torch.Generator().manual_seed(kv * 10 + q)
    query = torch.randn(1, 4, q, 16, generator=g)
    key = torch.randn(1, 2, kv, 16, generator=g)
    value = torch.randn(1, 2, kv, 16, generator=g)
    mask = torch.rand(1, 1, q, kv, generator=g) > 0.2
    mask[..., 0] = True  # no row fully masked
    out = {}
    for reuse in (True, False):
        A.REUSE_SCORES = reuse
        rec = A.VisualAttentionRecorder(span=(0, kv // 2))
        out[reuse] = (
            A.small_q_attention(query, key, value, None, 0.25, causal_tail=True, watch=(rec, 0)),
            A.small_q_attention(query, key, value, mask, 0.25),
            rec.scores[0],
        )
    for a, b in zip(out[True], out[False], strict=True):
        assert torch.equal(a, b)
    # and both are attention: SDPA with the same causal tail agrees to rounding
    causal = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)
    ref = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out[True][0], ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_the_scratch_buffer_grows_and_results_do_not_alias_it() -> None:
    g = torch.Generator().manual_seed(0)
    key = torch.randn(1, 2, 9000, 8, generator=g)
    value = torch.randn(1, 2, 9000, 8, generator=g)
    query = torch.randn(1, 4, 2, 8, generator=g)
    small = A.small_q_attention(query, key[:, :, :4500], value[:, :, :4500], None, 0.3, causal_tail=True)
    keep = small.clone()
    big = A.small_q_attention(query, key, value, None, 0.3, causal_tail=True)  # needs a larger buffer
    again = A.small_q_attention(query, key[:, :, :4500], value[:, :, :4500], None, 0.3, causal_tail=True)
    assert torch.equal(small, keep) and torch.equal(again, keep) and big.shape == small.shape


@pytest.mark.parametrize("kv", [37, 64, 300])
@pytest.mark.parametrize("rows", [1, 5])
def test_probs_times_values_split_over_the_keys_is_the_product(
    kv: int, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's split of probabilities x values over chunks of keys (forced here on the CPU, chunks of 16)
    is the plain product, on a view of a longer cache buffer, whole chunks or not."""
    monkeypatch.setattr(A, "PV_SPLIT_DEVICES", ("cpu",))
    monkeypatch.setattr(A, "PV_SPLIT_MIN", 32)
    monkeypatch.setattr(A, "PV_SPLIT_CHUNK", 16)
    g = torch.Generator().manual_seed(kv + rows)
    probs = torch.softmax(torch.randn(1, 2, rows, kv, generator=g), dim=-1)
    value = torch.randn(1, 2, kv + 20, 16, generator=g)[:, :, :kv]  # a view, as the cache hands it out
    split = A.probs_times_values(probs, value)
    torch.testing.assert_close(split, torch.matmul(probs, value), rtol=1e-5, atol=1e-6)
    if kv < 32:  # under the threshold: the plain product itself
        assert torch.equal(split, torch.matmul(probs, value))
    else:  # in bfloat16 about as close to the float32 product as the plain bfloat16 product is
        exact = torch.matmul(probs, value)
        low = A.probs_times_values(probs.bfloat16(), value.bfloat16())
        assert low.dtype == torch.bfloat16
        plain_err = (torch.matmul(probs.bfloat16(), value.bfloat16()).float() - exact).abs().max()
        assert (low.float() - exact).abs().max() <= 2 * plain_err + 1e-3
