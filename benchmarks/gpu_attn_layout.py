"""The decode attention's probabilities x values, one product against a split over the keys (for a GPU lease).

Session 26's per-op profile on an H200 (`benchmarks/results/h200-s26/gpu-profile.json`) found a vanilla step of
the reference model at 25.6k visual tokens spending 90% of its GPU time in one cuBLAS kernel, `gemmSN_NN`, at
0.74 ms a call: `probs [1, Hkv, g*q, kv] @ value [1, Hkv, kv, D]` with a few rows and a long reduction over the
keys. `decoders.attention.probs_times_values` now splits that product into chunks of keys off the CPU
(PV_SPLIT_MIN, PV_SPLIT_CHUNK). This times, side by side at each cache length and row count: the plain product,
the split at several chunk sizes, and the whole few-query attention (`small_q_attention`, which takes the
split where it applies) with and without the split; it checks the results agree. Runs on CPU too (a dry run:
the split is not used there by default).
Usage: python benchmarks/gpu_attn_layout.py --device cuda [--kv 512,1536,4096,25600] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from decoders import attention as A


def _timed(fn: Callable[..., torch.Tensor], args: tuple, device: torch.device, iters: int) -> float:
    """Median seconds of one call ``fn(*args)`` over `iters` calls (after 3 untimed), synchronising around each."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv", default="512,1536,4096,25600", help="cache lengths (keys)")
    p.add_argument("--rows", default="1,8", help="query rows (a decode step, a verify)")
    p.add_argument("--heads", type=int, default=4, help="query heads (the reference model: 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (the reference model: 2)")
    p.add_argument("--dim", type=int, default=32, help="head dim (the reference model: 32)")
    p.add_argument("--chunks", default="64,256,1024", help="split chunk sizes to time")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default="")
    a = p.parse_args()
    device = torch.device(a.device)
    kvs, rows_list = [int(x) for x in a.kv.split(",")], [int(x) for x in a.rows.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    doc: dict = {"device": str(device), "heads": a.heads, "kv_heads": a.kv_heads, "dim": a.dim, "rows": []}
    if device.type == "cuda":
        doc["gpu"] = torch.cuda.get_device_name()
    g = a.heads // a.kv_heads
    split_devices, split_min, split_chunk = A.PV_SPLIT_DEVICES, A.PV_SPLIT_MIN, A.PV_SPLIT_CHUNK
    print(
        "| keys | rows | product | "
        + " | ".join(f"split {c}" for c in chunks)
        + " | attention | split attention |"
    )
    print("|---:|---:|---:|" + "---:|" * (len(chunks) + 2))
    try:
        for kv in kvs:
            # a view of a longer buffer, as the preallocated cache hands it out
            value = torch.randn(1, a.kv_heads, kv + 64, a.dim, device=device, generator=gen)[:, :, :kv]
            key = torch.randn(1, a.kv_heads, kv + 64, a.dim, device=device, generator=gen)[:, :, :kv]
            for rows in rows_list:
                probs = torch.softmax(
                    torch.randn(1, a.kv_heads, g * rows, kv, device=device, generator=gen), -1
                )
                query = torch.randn(1, a.heads, rows, a.dim, device=device, generator=gen)
                mask = None if rows == 1 else torch.ones(1, 1, rows, kv, dtype=torch.bool, device=device)
                ref = torch.matmul(probs, value)
                row: dict = {"keys": kv, "rows": rows}
                A.PV_SPLIT_DEVICES = ()
                attn_args = (query, key, value, mask, a.dim**-0.5)
                row["product_ms"] = 1e3 * _timed(torch.matmul, (probs, value), device, a.iters)
                row["attention_ms"] = 1e3 * _timed(A.small_q_attention, attn_args, device, a.iters)
                plain_attn = A.small_q_attention(*attn_args)
                A.PV_SPLIT_DEVICES, A.PV_SPLIT_MIN = (device.type,), 1
                split_ms, diffs = {}, {}
                for c in chunks:
                    A.PV_SPLIT_CHUNK = c
                    got = A.probs_times_values(probs, value)
                    diffs[c] = float((got - ref).abs().max())
                    split_ms[c] = 1e3 * _timed(A.probs_times_values, (probs, value), device, a.iters)
                A.PV_SPLIT_CHUNK = split_chunk
                row["split_ms"], row["split_max_abs_diff"] = split_ms, diffs
                row["split_attention_ms"] = 1e3 * _timed(A.small_q_attention, attn_args, device, a.iters)
                split_attn = A.small_q_attention(*attn_args)
                row["attention_max_abs_diff"] = float((split_attn - plain_attn).abs().max())
                A.PV_SPLIT_DEVICES, A.PV_SPLIT_MIN = split_devices, split_min
                doc["rows"].append(row)
                cells = " | ".join(f"{split_ms[c]:.3f} ms" for c in chunks)
                print(
                    f"| {kv} | {rows} | {row['product_ms']:.3f} ms | {cells} | {row['attention_ms']:.3f} ms | "
                    f"{row['split_attention_ms']:.3f} ms |",
                    flush=True,
                )
    finally:
        A.PV_SPLIT_DEVICES, A.PV_SPLIT_MIN, A.PV_SPLIT_CHUNK = split_devices, split_min, split_chunk
    worst = max(max(r["split_max_abs_diff"].values()) for r in doc["rows"])
    print(f"largest difference from the plain product: {worst:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
