"""Attention memory on CPU: keys stored transposed ([B, Hkv, D, cap]) and scores in a reused buffer, against before.

"before" = keys stored [B, Hkv, cap, D] and a fresh score matrix per call (softmax into another fresh one);
"layout" = transposed keys only; "after" = transposed keys + the scratch score buffer with an in-place
softmax (as shipped: `decoders.cache`, `decoders.attention.REUSE_SCORES`). Timed side by side in one process,
variants interleaved block by block:
1. `small_q_attention` alone (the decode / verify / draft attention) on random keys of 0.6k-25.7k entries for
   1-8 query rows, with a bitwise comparison of the outputs.
2. On the reference model ("before" against "after"): one session per variant at each length (prefill time
   recorded); (a) one step, forward + logits of 1 row (a vanilla step) and of 5 rows (a verify), the two
   variants alternating call by call (--calls each); (b) whole answers: per repeat vanilla, Sparrow and StD
   (as shipped) on the four caption requests, the variants alternating prompt by prompt; decode time summed
   over the requests, medians over repeats; every answer is checked token-identical across variants.
Usage: python benchmarks/key_layout.py --max-frames 192,2048,3200 --repeats 5
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch
from gamma_policy import QUESTIONS

import decoders.attention as attention
from decoders.attention import small_q_attention
from decoders.cache import PreallocLayer
from decoders.engine import run
from decoders.proposers.sparrow import SparrowProposer
from decoders.proposers.std import StDProposer
from decoders.sampling import DecodeConfig
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status

VARIANTS = {"before": (False, False), "layout": (True, False), "after": (True, True)}  # (keys^T, reuse)
END_TO_END = ("before", "after")


def use(variant: str) -> None:
    PreallocLayer.transpose_keys_on_cpu, attention.REUSE_SCORES = VARIANTS[variant]


def attention_part(blocks: int) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(0)
    for kv in (600, 1700, 16500, 25700):
        k = torch.randn(1, 2, kv, 32, generator=g)
        v = torch.randn(1, 2, kv, 32, generator=g)
        stored_t = torch.zeros(1, 2, 32, kv + 256)
        stored_t[..., :kv] = k.transpose(-1, -2)
        stored = torch.zeros(1, 2, kv + 256, 32)
        stored[:, :, :kv] = k
        keys = {"before": stored[:, :, :kv], "layout": stored_t[..., :kv].transpose(-1, -2)}
        keys["after"] = keys["layout"]
        for q in (1, 2, 5, 8):
            query = torch.randn(1, 4, q, 32, generator=g)
            res, times = {}, {n: [] for n in VARIANTS}
            for n in VARIANTS:
                use(n)
                res[n] = small_q_attention(query, keys[n], v, None, 32**-0.5, causal_tail=True)
            calls = 20 if kv > 5000 else 200
            for _ in range(blocks):
                for n in VARIANTS:
                    use(n)
                    for _ in range(calls):
                        t = time.perf_counter()
                        small_q_attention(query, keys[n], v, None, 32**-0.5, causal_tail=True)
                        times[n].append(time.perf_counter() - t)
            ms = {n: statistics.median(times[n]) * 1e3 for n in VARIANTS}
            row = {
                "keys": kv,
                "query_rows": q,
                **{f"{n}_ms": round(ms[n], 4) for n in VARIANTS},
                "layout_speedup": round(ms["before"] / ms["layout"], 3),
                "after_speedup": round(ms["before"] / ms["after"], 3),
                "bitwise_equal": all(torch.equal(res["before"], r) for r in res.values()),
            }
            print(row, flush=True)
            out.append(row)
    return out


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "192,2048,3200", "benchmarks/results/key-layout.json")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--attention-only", action="store_true", help="part 1 only (no model sessions)")
    p.add_argument(
        "--calls", type=int, default=300, help="alternating step timings per variant and row count"
    )
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    attn_rows = attention_part(a.blocks)
    cfg = DecodeConfig(max_new_tokens=96)
    prompts = [lm.suffix_ids(q) for q in QUESTIONS]
    methods = ("vanilla", "sparrow", "std")
    out = []
    try:
        for mf in [] if a.attention_only else common.frame_counts(a.max_frames):
            sessions = {}
            for name in END_TO_END:
                use(name)
                sessions[name] = common.session_at(lm, a.video, mf)
            # (a) one step: forward + logits of r new rows, variants alternating call by call
            steps: dict[tuple[str, int], list[float]] = {(n, r): [] for n in END_TO_END for r in (1, 5)}
            base = {}
            for name, session in sessions.items():
                base[name] = session.length
            suffix = prompts[0]
            for name, session in sessions.items():
                use(name)
                session.extend(suffix)
            for _ in range(a.calls):
                for r in (1, 5):
                    for name in END_TO_END:
                        use(name)
                        session = sessions[name]
                        n0 = session.length
                        t = time.perf_counter()
                        lm.logits(session.extend(list(range(40, 40 + r)))[0])
                        steps[(name, r)].append(time.perf_counter() - t)
                        session.truncate(n0)
            for name, session in sessions.items():
                session.truncate(base[name])
            # (b) whole answers, variants alternating prompt by prompt
            want: list[list[int]] | None = None
            times = {(n, m): [] for n in END_TO_END for m in methods}
            for _ in range(a.repeats):
                for m in methods:
                    total = {n: 0.0 for n in END_TO_END}
                    answers: dict[str, list[list[int]]] = {n: [] for n in END_TO_END}
                    for q in prompts:
                        for name in END_TO_END:
                            use(name)  # StD's compact caches follow the session's variant
                            prop = (
                                SparrowProposer(head)
                                if m == "sparrow"
                                else StDProposer()
                                if m == "std"
                                else None
                            )
                            res = run(sessions[name], q, cfg, prop)
                            total[name] += res.stats.decode_s
                            answers[name].append(res.tokens)
                    for name in END_TO_END:
                        want = want or answers[name]
                        assert answers[name] == want, f"{m} {name} changed an answer"
                        times[(name, m)].append(total[name])
            med = {k: statistics.median(v) for k, v in times.items()}
            row: dict = {
                "visual_tokens": sessions["after"].num_visual_tokens,
                "prefill_s": {n: round(s.prefill_s, 3) for n, s in sessions.items()},
                "step_ms": {
                    f"{n} {r} rows": round(statistics.median(v) * 1e3, 4) for (n, r), v in steps.items()
                },
                "decode_s": {f"{n} {m}": round(med[(n, m)], 4) for n, m in med},
            }
            for r in (1, 5):
                row[f"step of {r} rows: after over before"] = round(
                    statistics.median(steps[("before", r)]) / statistics.median(steps[("after", r)]), 3
                )
            for m in methods:
                row[f"{m}: after over before"] = round(med[("before", m)] / med[("after", m)], 3)
            for n in END_TO_END:
                for m in methods[1:]:
                    row[f"{m} vs vanilla, {n}"] = round(med[(n, "vanilla")] / med[(n, m)], 3)
            print(row, flush=True)
            out.append(row)
            del sessions
    finally:
        use("after")
    doc = {
        "model": a.model,
        "video": a.video,
        "threads": a.threads,
        "repeats": a.repeats,
        "blas": cpu_status(),
        "attention": attn_rows,
        "results": out,
    }
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()
    main()
