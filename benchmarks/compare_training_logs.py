"""Compare two `vidspec train-reference` logs step by step (same seed and data stream: paired by step).

The batch of a step is a pure function of (seed, step), so two runs of one seed see the same videos and
questions; their logged losses at one step differ only by the recipe. Prints, per window of steps, the
mean QA loss, caption loss and teacher-forced first-answer-token accuracy of each run and the paired
difference (B - A). Windows are set by ``--window``; only steps logged by both runs are compared.

    python benchmarks/compare_training_logs.py A.log [A2.log ...] --vs B.log [B2.log ...] --window 500
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_LINE = re.compile(r"^step (\d+)/\d+ \[([\d.]+) min\] (.*?) lr ")
_FIELD = re.compile(r"(loss|qa|cap|aux|acc1|cnt|att) (nan|[-\d.]+)")
KEYS = ("qa", "cap", "acc1")


def parse(paths: list[Path]) -> dict[int, dict[str, float]]:
    """step -> logged fields (later files override earlier ones at the same step)."""
    out: dict[int, dict[str, float]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            m = _LINE.match(line)
            if not m:
                continue
            rec = {k: float(v) for k, v in _FIELD.findall(m.group(3))}
            rec["min"] = float(m.group(2))
            out[int(m.group(1))] = rec
    return out


def compare(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], window: int) -> list[dict]:
    steps = sorted(set(a) & set(b))
    rows: list[dict] = []
    for lo in range(0, (steps[-1] if steps else 0) + 1, window):
        sel = [s for s in steps if lo < s <= lo + window]
        if not sel:
            continue
        row: dict = {"steps": f"{lo + 1}-{lo + window}", "n": len(sel)}
        for k in KEYS:
            pairs = [(a[s][k], b[s][k]) for s in sel if k in a[s] and k in b[s]]
            if not pairs:
                continue
            ma = sum(p[0] for p in pairs) / len(pairs)
            mb = sum(p[1] for p in pairs) / len(pairs)
            wins = sum((p[1] < p[0]) if k != "acc1" else (p[1] > p[0]) for p in pairs)
            row[k] = {"a": round(ma, 4), "b": round(mb, 4), "b_minus_a": round(mb - ma, 4), "b_better": wins}
        row["minutes"] = {"a": a[sel[-1]]["min"], "b": b[sel[-1]]["min"]}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", nargs="+", type=Path, help="log(s) of run A (the baseline)")
    p.add_argument("--vs", nargs="+", type=Path, required=True, help="log(s) of run B")
    p.add_argument("--window", type=int, default=500)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = compare(parse(args.a), parse(args.vs), args.window)
    if not rows:
        print("no step is logged by both runs", file=sys.stderr)
        return 1
    print(f"{'steps':>11} {'n':>3} | " + " | ".join(f"{k:>5} A -> B (B better)" for k in KEYS) + " | min A/B")
    for r in rows:
        cells = []
        for k in KEYS:
            c = r.get(k)
            cells.append(f"{c['a']:.3f} -> {c['b']:.3f} ({c['b_better']:>2})" if c else " " * 24)
        print(
            f"{r['steps']:>11} {r['n']:>3} | "
            + " | ".join(cells)
            + f" | {r['minutes']['a']}/{r['minutes']['b']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
