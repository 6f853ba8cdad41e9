"""The preallocated cache writes in place, rolls back by a length change and protects the visual prefix."""

from __future__ import annotations

import pytest
import torch

from decoders.cache import KVCache


def _kv(n: int, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((1, 2, n, 4), value), torch.full((1, 2, n, 4), -value)


def test_appends_write_in_place_without_reallocating() -> None:
    c = KVCache(num_layers=2, kv_heads=2, head_dim=4, capacity=16)
    ptr = c.layers[0].keys.data_ptr()
    for i in range(10):
        k, _v = c.layers[0].update(*_kv(1, float(i)))
        assert k.shape == (1, 2, i + 1, 4) and k.data_ptr() == ptr
    assert c.layers[0].keys[0, 0, 9, 0] == 9.0 and c.layers[0].values[0, 1, 3, 0] == -3.0


def test_truncate_is_a_length_change_and_later_writes_overwrite() -> None:
    c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=8)
    c.update(*_kv(5, 1.0), layer_idx=0)
    ptr = c.layers[0].keys.data_ptr()
    c.truncate(2)
    assert c.length == 2 and c.get_seq_length() == 2 and c.layers[0].keys.data_ptr() == ptr
    k, _ = c.update(*_kv(1, 7.0), layer_idx=0)
    assert k.shape[2] == 3 and float(k[0, 0, 2, 0]) == 7.0


def test_the_protected_prefix_cannot_be_truncated_away() -> None:
    c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=8)
    c.update(*_kv(4, 1.0), layer_idx=0)
    c.protect()
    with pytest.raises(ValueError, match="protected"):
        c.truncate(3)
    with pytest.raises(ValueError, match="only 4"):
        c.truncate(5)
    c.truncate(4)


def test_overflow_grows_capacity_and_keeps_contents() -> None:
    c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=2)
    c.update(*_kv(2, 3.0), layer_idx=0)
    k, _ = c.update(*_kv(3, 4.0), layer_idx=0)
    assert c.capacity >= 5 and k.shape[2] == 5
    assert float(k[0, 0, 1, 0]) == 3.0 and float(k[0, 0, 4, 0]) == 4.0


def test_mask_sizes_follow_the_valid_length() -> None:
    c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=32)
    c.update(*_kv(6, 1.0), layer_idx=0)
    assert c.get_mask_sizes(3, 0) == (9, 0)


def test_gather_builds_a_compact_cache_per_kv_head() -> None:
    c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=8)
    keys = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 2, 8, 4).contiguous()
    c.update(keys, -keys, layer_idx=0)
    idx = torch.tensor([[[0, 5, 7], [1, 2, 3]]])  # [B, Hkv, k]
    g = c.gather([idx])
    k, v = g.layer_kv(0)
    assert g.length == 3
    assert k[0, 0, :, 0].tolist() == [0.0, 5.0, 7.0] and k[0, 1, :, 0].tolist() == [1.0, 2.0, 3.0]
    assert v[0, 1, :, 0].tolist() == [-1.0, -2.0, -3.0]


def test_keys_are_stored_transposed_on_cpu_behind_the_usual_view() -> None:
    c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=6)
    layer = c.layers[0]
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    keys, _ = c.update(k, -k, layer_idx=0)
    assert keys.shape == (1, 2, 3, 4) and torch.equal(keys, k)
    # the storage is [B, Hkv, D, cap], row-major: K^T of one head is a plain matrix for the score GEMM
    assert layer.keys.transpose(-1, -2).is_contiguous() and layer.keys.shape == (1, 2, 6, 4)
    # growing past the capacity keeps the entries and the layout
    more = torch.ones(1, 2, 5, 4)
    keys, _ = c.update(more, more, layer_idx=0)
    assert c.capacity >= 8 and torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3:], more)
    assert layer.keys.transpose(-1, -2).is_contiguous()
    # a gathered compact cache holds the same entries
    idx = torch.tensor([[[0, 2, 4], [1, 3, 7]]])
    compact = c.gather([idx])
    for h in range(2):
        assert torch.equal(compact.layers[0].keys[0, h, :3], keys[0, h, idx[0, h]])
        assert torch.equal(compact.layers[0].values[0, h, :3], c.layers[0].values[0, h, idx[0, h]])


def test_the_old_key_layout_stays_available_for_measurement() -> None:
    from decoders.cache import PreallocLayer

    PreallocLayer.transpose_keys_on_cpu = False
    try:
        c = KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=6)
        assert c.layers[0].keys.is_contiguous() and not c.layers[0].keys_transposed
    finally:
        PreallocLayer.transpose_keys_on_cpu = True
    assert KVCache(num_layers=1, kv_heads=2, head_dim=4, capacity=6).layers[0].keys_transposed
