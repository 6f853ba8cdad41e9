"""Would a draft tree pay for the Sparrow head? Ranks along the true path, static trees replayed on measured costs.

For each caption request the vanilla answer T is decoded once. Then, teacher-forced at every position p of T,
the head drafts along T itself for --depth steps (fed its own predicted features, as in any draft) and records
the rank of T's token in its distribution at every depth, plus the target's own top-1 probability at p (how
sure the model is of the token the head must guess). A full tree that expands the top-k_j children at depth j
contains T's continuation up to depth m exactly when rank_j < k_j for every j <= m, so every static tree shape
(k_1, k_2, ...) and every chain (1, 1, ...) is replayed exactly on the same positions: tokens per cycle =
1 + mean accepted depth. Costs, measured on the same session: v(r), forward + logits of r rows on the dense
cache (r = 1 + tree nodes: one verify with a tree mask costs at least what r causal rows do), and the head's
step on w rows (one call per tree level). Modelled speedup over vanilla = tokens * v(1) / cost.
The comparison is generous to trees: their verify is costed as r causal rows (a tree mask is no cheaper) and
the extra bookkeeping (tree masks, KV compaction of the accepted branch) is left out.
Usage: python benchmarks/draft_tree.py --max-frames 64,192,3200
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch
from gamma_policy import QUESTIONS, verify_table

import decoders.proposers.sparrow as sparrow_mod
from decoders.engine import Verified, run
from decoders.proposers.sparrow import HeadKV, SparrowProposer
from decoders.sampling import DecodeConfig
from infra.cpu import ensure_fast_blas
from infra.cpu import status as cpu_status

SHAPES = [
    *[(1,) * g for g in range(2, 9)],
    (2, 1, 1, 1),
    (2, 1, 1, 1, 1, 1),
    (3, 1, 1, 1, 1),
    (2, 2, 1, 1, 1),
    (2, 2, 2, 1, 1),
    (3, 2, 1, 1),
    (4, 1, 1, 1, 1),
]  # at most 31 nodes: a verify of 32 rows is the lean path's limit (`decoders.attention.SMALL_Q`)


def tree_nodes(shape: tuple[int, ...]) -> list[int]:
    """Nodes per level of a full tree expanding k_j children at depth j."""
    out, width = [], 1
    for k in shape:
        width *= k
        out.append(width)
    return out


def ranks_along_answer(
    session, head, prompt: list[int], answer: list[int], depth: int
) -> list[tuple[list[int], float]]:
    """[(rank of the answer's token at each depth, the target's top-1 probability there)] per position."""
    want: list[int] = []
    ranks: list[int] = []
    orig = sparrow_mod.draft_token

    def forced(logits: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator | None) -> tuple[int, None]:
        w = want[len(ranks)]
        ranks.append(int((logits > logits[w]).sum()))
        return w, None

    prop = SparrowProposer(head, gamma=depth, adaptive=False, gamma_max=depth)
    out = []
    sparrow_mod.draft_token = forced  # type: ignore[assignment]
    try:
        with torch.inference_mode(), session.prompt():
            prop.prefill(session, prompt, DecodeConfig(max_new_tokens=len(answer) + depth + 2))
            lm = session.lm
            for p in range(len(answer) - 1):
                want[:] = answer[p + 1 : p + 1 + depth]
                ranks.clear()
                prop.propose(answer[p], len(want))
                start = session.length
                h = session.extend([answer[p]])  # commit the pending token only (teacher forcing)
                # the target's own confidence in the token the first draft must guess (answer[p + 1])
                out.append((list(ranks), float(torch.softmax(lm.logits(h[0, -1]), -1).max())))
                prop.observe(Verified(start, len(want), 0, [answer[p]], answer[p + 1], h[0, :1]))
    finally:
        sparrow_mod.draft_token = orig  # type: ignore[assignment]
    return out


def head_step_table(lm, head, widths: list[int], calls: int) -> dict[int, float]:
    """Median seconds of one head step (+ logits) on w rows, over a 32-entry head cache."""
    kv = HeadKV.empty(head.cfg, 256, lm.dtype, lm.device)
    table = head.token_rows(lm.text_model.embed_tokens.weight)
    out = {}
    with torch.inference_mode():
        for w in widths:
            feat = torch.randn(1, w, lm.hidden_size)
            rows = table[torch.arange(w) % table.shape[0]] if table is not None else None
            times = []
            for _ in range(calls):
                kv.length = 32
                t = time.perf_counter()
                if rows is not None:
                    g = head.step_rows(rows, feat, kv)
                else:
                    g = head.step(lm.embed(torch.arange(w)[None]), feat, kv)
                lm.logits(g[0])
                times.append(time.perf_counter() - t)
            out[w] = statistics.median(times)
    return out


def replay(data: list[tuple[list[int], float]], shape: tuple[int, ...]) -> float:
    """Mean tokens per cycle (accepted depth + 1) of a full tree `shape` over teacher-forced positions."""
    total = 0
    for ranks, _ in data:
        m = 0
        while m < len(shape) and m < len(ranks) and ranks[m] < shape[m]:
            m += 1
        total += m + 1
    return total / len(data)


@torch.inference_mode()
def main() -> None:
    p = common.parser(__doc__, "64,192,3200", "benchmarks/results/draft-tree.json")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--calls", type=int, default=40)
    a = p.parse_args()
    lm, head = common.model_and_head(a)
    prompts = [lm.suffix_ids(q) for q in QUESTIONS]
    max_nodes = max(sum(tree_nodes(s)) for s in SHAPES)
    widths = sorted({w for s in SHAPES for w in tree_nodes(s)})
    steps = head_step_table(lm, head, widths, 400)
    out = []
    for mf in common.frame_counts(a.max_frames):
        session = common.session_at(lm, a.video, mf)
        verify = verify_table(session, prompts[0], a.calls, max_nodes + 1)
        data = []
        for q in prompts:
            answer = run(session, q, DecodeConfig(max_new_tokens=96)).tokens
            data += ranks_along_answer(session, head, q, answer, a.depth)
        v1 = verify[0]
        shapes = []
        for shape in SHAPES:
            nodes = tree_nodes(shape)
            cost = sum(steps[w] for w in nodes) + verify[sum(nodes)]
            tok = replay(data, shape)
            shapes.append(
                {
                    "shape": list(shape),
                    "nodes": sum(nodes),
                    "tokens_per_cycle": round(tok, 3),
                    "cycle_ms": round(cost * 1e3, 3),
                    "modelled_speedup": round(tok * v1 / cost, 3),
                }
            )
        depth_rank = []
        for j in range(a.depth):
            at = [r[j] for r, _ in data if len(r) > j]
            depth_rank.append(
                {
                    "depth": j + 1,
                    "n": len(at),
                    "rank0": round(sum(x == 0 for x in at) / len(at), 3),
                    "rank1": round(sum(x == 1 for x in at) / len(at), 3),
                    "rank2+": round(sum(x >= 2 for x in at) / len(at), 3),
                }
            )
        sure = [(r[0] == 0, tp) for r, tp in data if r]
        confident = [ok for ok, tp in sure if tp >= 0.5]
        unsure = [ok for ok, tp in sure if tp < 0.5]
        row = {
            "visual_tokens": session.num_visual_tokens,
            "positions": len(data),
            "target_top1_mean": round(statistics.mean(tp for _, tp in data), 3),
            "target_top1_below_0.5": round(sum(tp < 0.5 for _, tp in data) / len(data), 3),
            "head_depth1_hit_when_target_sure": round(sum(confident) / max(1, len(confident)), 3),
            "head_depth1_hit_when_target_unsure": round(sum(unsure) / max(1, len(unsure)), 3),
            "ranks_by_depth": depth_rank,
            "shapes": shapes,
            "verify_s_by_rows": verify,
            "ranks": [r for r, _ in data],
            "target_top1": [round(tp, 4) for _, tp in data],
        }
        best = max(shapes, key=lambda s: s["modelled_speedup"])
        print(
            mf,
            session.num_visual_tokens,
            {k: v for k, v in row.items() if k not in ("ranks", "target_top1", "shapes", "verify_s_by_rows")},
            flush=True,
        )
        for s in shapes:
            print("   ", s, flush=True)
        print("  best", best, flush=True)
        out.append(row)
    doc = {
        "model": a.model,
        "video": a.video,
        "threads": a.threads,
        "blas": cpu_status(),
        "head_step_s_by_rows": steps,
        "results": out,
    }
    common.write_json(a.json, doc)


if __name__ == "__main__":
    ensure_fast_blas()
    main()
