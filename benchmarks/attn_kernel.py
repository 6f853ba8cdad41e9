"""The native one-pass attention kernel against torch's two-GEMM attention, side by side in one process.

1. `small_q_attention` alone on random keys in the cache's layout (one layer, 2 KV heads, head dim 32 as
   the reference model): 1-17 query rows over 0.5k-25.7k keys.
2. A whole decode-path forward of the reference model (`session.extend` of n tokens + logits, as a vanilla
   step (n = 1) or a verify pass (n > 1) runs) on real sessions of the bench video, kernel on and off
   alternating call by call, so drift on this shared machine hits both alike.
3. The one-call native step (`decoders.kernels.NativeStep`, StD's draft step) against the torch forward
   (`FastDecoder.forward`, which uses the kernel of 1. for its attention) for one token, on StD's draft cache
   of each session (budget 1024) and on the dense cache, alternating call by call.
Reported: median microseconds per call and the ratio torch / kernel; max |difference| of the outputs.
Usage: python benchmarks/attn_kernel.py --max-frames 192,2048,3200 --rows 1,3,5,9
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

from decoders import attention, kernels
from decoders.attention import small_q_attention
from decoders.cache import PreallocLayer
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status


def timed(fn: object, calls: int) -> dict[str, list[float]]:
    """fn(use_kernel) for both settings, alternating call by call: seconds per call for each."""
    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    for _ in range(calls):
        for name in times:
            attention.USE_KERNEL = name == "kernel"
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    attention.USE_KERNEL = True
    return times


def summary(times: dict[str, list[float]]) -> dict[str, float]:
    t, k = (statistics.median(times[n]) * 1e6 for n in ("torch", "kernel"))
    return {"torch_us": round(t, 1), "kernel_us": round(k, 1), "ratio": round(t / k, 3)}


@torch.inference_mode()
def micro(lengths: list[int], rows: list[int], calls: int) -> list[dict]:
    out = []
    torch.manual_seed(0)
    for n in lengths:
        layer = PreallocLayer(1, 2, 32, n + 64, torch.float32, torch.device("cpu"))
        keys, values = layer.update(torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32))
        for r in rows:
            q = torch.randn(1, 4, r, 32)

            def call(q: torch.Tensor = q, k: torch.Tensor = keys, v: torch.Tensor = values) -> torch.Tensor:
                return small_q_attention(q, k, v, None, 32**-0.5, causal_tail=True)

            attention.USE_KERNEL = False
            ref = call()
            attention.USE_KERNEL = True
            err = (call() - ref).abs().max().item()
            row = {"keys": n, "rows": r, **summary(timed(call, calls)), "max_abs_diff": err}
            print(row, flush=True)
            out.append(row)
    return out


@torch.inference_mode()
def whole_step(a: object, lm: object, rows: list[int], calls: int) -> list[dict]:
    out = []
    for session in common.prompted_sessions(lm, a.video, a.max_frames):
        n0 = session.length
        for n in rows:
            ids = list(range(40, 40 + n))

            def call(ids: list[int] = ids, s: object = session, n0: int = n0) -> torch.Tensor:
                logits = lm.logits(s.extend(ids)[0])
                s.truncate(n0)
                return logits

            attention.USE_KERNEL = False
            ref = call()
            attention.USE_KERNEL = True
            err = (call() - ref).abs().max().item()
            row = {
                "visual_tokens": session.num_visual_tokens,
                "rows": n,
                **summary(timed(call, calls)),
                "max_abs_logit_diff": err,
            }
            print(row, flush=True)
            out.append(row)
    return out


@torch.inference_mode()
def native_step(a: object, lm: object, calls: int) -> list[dict]:
    from decoders.proposers.std import StDConfig, StDProposer
    from decoders.sampling import DecodeConfig

    native = lm.fast.native_step()
    out = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        with session.prompt():
            std = StDProposer(StDConfig(budget=1024))
            std.prefill(session, lm.suffix_ids("describe the video ."), DecodeConfig())
            pos = session.length + session.rope_delta
            for name, cache in (("draft_cache", std.draft_cache), ("dense_cache", session.cache)):
                n0 = cache.length
                ids = torch.tensor([[40]])
                times: dict[str, list[float]] = {"torch": [], "kernel": []}
                for _ in range(calls):
                    for kind, fn in (("torch", lm.fast.forward), ("kernel", native.step)):
                        t = time.perf_counter()
                        h = fn(ids, pos, cache)
                        times[kind].append(time.perf_counter() - t)
                        cache.truncate(n0)
                        if kind == "torch":
                            ref = h
                        else:
                            err = (h - ref).abs().max().item()
                row = {
                    "visual_tokens": session.num_visual_tokens,
                    "cache": name,
                    "entries": n0,
                    **summary(times),
                    "max_abs_hidden_diff": err,
                }
                print(row, flush=True)
                out.append(row)
    return out


def main() -> None:
    ensure_fast_blas()
    p = common.parser(__doc__, "192,2048,3200", "benchmarks/results/attn-kernel.json")
    p.add_argument("--rows", default="1,3,5,9")
    p.add_argument("--lengths", default="512,1536,4096,16384,25700", help="keys, for the attention-only part")
    p.add_argument("--micro-calls", type=int, default=200)
    p.add_argument("--calls", type=int, default=100)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not kernels.available():
        raise SystemExit("the attention kernel is not available here (no g++, or VIDSPEC_ATTN_KERNEL=0)")
    rows = common.frame_counts(a.rows)
    doc = {
        "threads": a.threads,
        "cpu": cpu_status(),
        "kernel": str(kernels.library_path()),
        "attention_only": micro(common.frame_counts(a.lengths), rows, a.micro_calls),
    }
    lm, _ = common.model_and_head(a)
    doc["whole_step"] = whole_step(a, lm, rows, a.calls)
    doc["native_step"] = native_step(a, lm, a.calls)
    common.write_json(a.json, doc)


if __name__ == "__main__":
    main()
