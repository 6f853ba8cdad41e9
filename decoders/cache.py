"""A preallocated KV cache that writes in place and rolls back by moving a length.

Contract:
- `KVCache` is a transformers `Cache`, so a stock decoder stack writes into it during `forward(cache=...)`.
- Every layer owns one buffer `[batch, kv_heads, capacity, head_dim]` for keys and one for values. `update`
  copies only the new entries into the buffer and returns views of the first `length` entries: no
  `torch.cat` of the whole cache per step (the stock `DynamicCache` does that and is 4-5x slower at 32k).
- `truncate(n)` rolls back by setting the length; nothing is copied or freed. The first `protected` entries
  (the visual prefix of a session) can never be truncated away.
- When an append would overflow, capacity grows geometrically (one copy, amortised); size the cache up
  front to avoid it.
- `gather(indices)` builds a compact cache holding a subset of entries per layer and KV head (the sparse
  draft cache of StD); `CompactKVCache` is the same class with its own, smaller buffers.
- On CPU the keys are stored transposed, `[batch, kv_heads, head_dim, capacity]`, and `layer.keys` is the
  `[batch, kv_heads, capacity, head_dim]` view of that buffer, so every caller sees the usual shape. Why: the
  attention scores of a few queries are `q @ K^T`, and MKL's GEMM against a row-major K^T is faster than
  against a transposed view of K (skinny reduction over head_dim): with this layout alone
  `decoders.attention.small_q_attention` ran 1.14-1.33x faster at 16.5k-25.7k keys and 1.07-1.15x at
  0.6k-1.7k, for 1 to 8 query rows, bitwise-identical outputs (`benchmarks/key_layout.py`). Kernels that
  want contiguous keys (SDPA in the chunked prefill) get a contiguous copy
  (`decoders.attention.vidspec_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocLayer(CacheLayerMixin):
    """One layer's keys and values in a preallocated buffer; `length` entries are valid."""

    is_croppable = True
    is_sliding = False
    transpose_keys_on_cpu = True  # the key layout (module docstring); False only to measure the old one

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.device = torch.device(device)
        self.keys_transposed = self.device.type == "cpu" and self.transpose_keys_on_cpu
        super().__init__()  # sets keys/values to None (through the setter below)
        shape = (batch, kv_heads, capacity, head_dim)
        self._keys = self._zero_keys(shape, dtype)  # `keys` is its [B, Hkv, cap, D] view
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [B, Hkv, cap, D]
        self.length = 0
        self.is_initialized = True

    def _zero_keys(self, shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed key buffer for [B, Hkv, cap, D] in the stored layout ([B, Hkv, D, cap] on CPU)."""
        b, h, cap, d = shape
        stored = (b, h, d, cap) if self.keys_transposed else shape
        return torch.zeros(stored, dtype=dtype, device=self.device)

    @property
    def keys(self) -> torch.Tensor | None:
        """The key buffer as [B, Hkv, cap, D] (a transposed view of the stored [B, Hkv, D, cap] on CPU)."""
        k = self._keys
        return k.transpose(-1, -2) if (k is not None and self.keys_transposed) else k

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        # stored so that the valid keys of one head, as K^T [D, length], are rows of a row-major matrix
        if value is not None and self.keys_transposed:
            value = value.transpose(-1, -2).contiguous()
        self._keys = value

    @property
    def capacity(self) -> int:
        return self.values.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Buffers exist from construction; nothing to do.
        return None

    def reserve(self, capacity: int) -> None:
        """Grow the buffers to hold at least `capacity` entries (one copy of the valid part)."""
        if capacity <= self.capacity:
            return
        b, h, _, d = self.values.shape
        values = torch.zeros((b, h, capacity, d), dtype=self.values.dtype, device=self.values.device)
        values[:, :, : self.length] = self.values[:, :, : self.length]
        old_keys = self.keys
        self._keys = self._zero_keys((b, h, capacity, d), values.dtype)  # no full-size copy via the setter
        self.keys[:, :, : self.length] = old_keys[:, :, : self.length]
        self.values = values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]  # key_states: [B, Hkv, n, D]
        end = self.length + n
        if end > self.capacity:
            self.reserve(max(end, int(self.capacity * 1.5) + 64))
        keys = self.keys  # one view per call (on CPU a transposed view of the stored buffer)
        keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        # transformers 5.x semantics: a negative count of entries to drop.
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of entries to remove")
        self.length = max(0, self.length + tokens_to_remove)


class KVCache(Cache):
    """Preallocated KV cache for a whole decoder stack. See the module docstring."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        layers = [
            PreallocLayer(batch, kv_heads, head_dim, capacity, dtype, torch.device(device))
            for _ in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.protected = 0

    # -- the small API the decoders use -------------------------------------------------------------
    @property
    def length(self) -> int:
        """Number of valid entries (the same in every layer between forward passes)."""
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def nbytes(self) -> int:
        """Bytes held by the buffers (allocated, not just valid)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def valid_nbytes(self) -> int:
        per_entry = sum(layer.keys[:, :, :1].nbytes + layer.values[:, :, :1].nbytes for layer in self.layers)
        return per_entry * self.length

    def reserve(self, capacity: int) -> None:
        for layer in self.layers:
            layer.reserve(capacity)

    def protect(self, n: int | None = None) -> None:
        """Forbid truncation below `n` entries (default: the current length)."""
        self.protected = self.length if n is None else n

    def truncate(self, n: int) -> None:
        """Keep the first `n` entries of every layer: a length change, no copy."""
        if n < self.protected:
            raise ValueError(f"cannot truncate to {n}: the first {self.protected} entries are protected")
        if n > self.length:
            raise ValueError(f"cannot truncate to {n}: only {self.length} entries are valid")
        for layer in self.layers:
            layer.length = n

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of entries to remove")
        self.truncate(self.length + tokens_to_remove)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the valid keys and values of one layer: [B, Hkv, length, D] each."""
        layer = self.layers[layer_idx]
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]

    def gather(self, indices: Sequence[torch.Tensor], extra_capacity: int = 64) -> KVCache:
        """A new compact cache holding, per layer, the entries `indices[layer]` ([B, Hkv, k] positions).

        The gathered entries keep their order; the compact cache's `length` is k, with room for
        `extra_capacity` more entries appended after them.
        """
        assert len(indices) == len(self.layers)
        first = self.layers[0]
        b, h, _, d = first.keys.shape
        k = indices[0].shape[-1]
        out = KVCache(
            len(self.layers), h, d, k + extra_capacity, first.keys.dtype, first.keys.device, batch=b
        )
        for src, dst, idx in zip(self.layers, out.layers, indices):
            assert idx.shape == (b, h, k), f"indices must be [B, Hkv, k], got {tuple(idx.shape)}"
            gather_idx = idx.unsqueeze(-1).expand(b, h, k, d)  # [B, Hkv, k, D]
            torch.gather(src.keys[:, :, : src.length], 2, gather_idx, out=dst.keys[:, :, :k])
            torch.gather(src.values[:, :, : src.length], 2, gather_idx, out=dst.values[:, :, :k])
            dst.length = k
        return out

    def copy_from(self, src: KVCache, src_start: int, count: int) -> None:
        """Append `count` entries of `src` starting at `src_start` (same positions in every layer)."""
        for s, d in zip(src.layers, self.layers):
            d.update(
                s.keys[:, :, src_start : src_start + count], s.values[:, :, src_start : src_start + count]
            )
