"""Roofline-style estimate of StD's decode speedup for Qwen2-VL-7B on one H200 (bf16).

Decode on a GPU at small batch is memory-bound: a forward pass costs the bytes it reads. Per step,
  vanilla:  weights + batch * L * kv_bytes_per_token              (the whole visual + text KV)
  StD draft: weights + batch * K * kv_bytes_per_token             (K = 1024 gathered entries)
  verify:   ~ one vanilla step (gamma + 1 tokens read the same bytes; compute stays far below the roof)
A cycle is gamma draft steps + one verify and commits tau tokens (mean accepted length, bonus included):
  speedup = tau * t_vanilla / (gamma * t_draft + t_verify).
Usage: python benchmarks/roofline.py --tau 3.1 --gamma 9   (tau measured on the reference model)
"""

from __future__ import annotations

import argparse

# Qwen2-VL-7B language model (config of the public release)
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 28, 3584, 28, 4, 128, 18944, 152064
BYTES = 2  # bf16
H200_BW = 4.8e12  # bytes/s HBM3e (peak; the ratio is what matters)
H200_FLOPS = 989e12  # dense bf16


def weights_bytes() -> float:
    attn = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2  # q, o + k, v
    mlp = 3 * HIDDEN * INTER
    return (LAYERS * (attn + mlp) + HIDDEN * VOCAB) * BYTES  # + lm_head (embedding rows are negligible)


KV_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * BYTES


def step_s(context: int, batch: int, tokens: int = 1) -> float:
    mem = (weights_bytes() + batch * context * KV_PER_TOKEN) / H200_BW
    flops = 2 * weights_bytes() / BYTES * batch * tokens / H200_FLOPS
    return max(mem, flops)


def speedup(context: int, batch: int, tau: float, gamma: int, budget: int = 1024) -> float:
    vanilla = step_s(context, batch)
    cycle = gamma * step_s(budget, batch) + step_s(context, batch, tokens=gamma + 1)
    return tau * vanilla / cycle


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tau", type=float, nargs="+", default=[3.0, 6.0, 8.0])
    p.add_argument("--gamma", type=int, default=9)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    a = p.parse_args()
    print(f"weights {weights_bytes() / 1e9:.2f} GB/step, KV {KV_PER_TOKEN / 1024:.0f} KiB/token")
    print("| batch | visual tokens | vanilla step ms | draft step ms | tau | gamma | est. speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in a.batch:
        for ctx in (16_384, 65_536):
            for tau in a.tau:
                print(
                    f"| {b} | {ctx} | {step_s(ctx, b) * 1e3:.2f} | {step_s(1024, b) * 1e3:.2f} | {tau:g} | {a.gamma} "
                    f"| {speedup(ctx, b, tau, a.gamma):.2f}x |"
                )


if __name__ == "__main__":
    main()
