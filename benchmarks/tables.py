"""Markdown tables for the README from `vidspec bench` JSON files (no figure is typed by hand).

Usage: python benchmarks/tables.py benchmarks/results/reference-methods.json [--cycles]
  default: `vidspec bench`'s own table (one row per length and method).
  --cycles: where a cycle's time goes per length (vanilla step; for each drafter: draft step x drafts per
  cycle, verify pass, StD's one-off gather, whole cycle, tokens per cycle).
  --spread: the run-to-run noise: per length and method, the speedup over vanilla in each repeat (the
  methods of one repeat run back to back, so repeat i of a method is paired with repeat i of vanilla), as
  min - median - max over the repeats (the median is the table's paired speedup).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pipeline.bench import format_table, per_repeat_speedups


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f} ms"


def cycles_table(doc: dict) -> list[str]:
    by_len: dict[int, dict[str, dict]] = {}
    for r in doc["results"]:
        by_len.setdefault(r["visual_tokens"], {})[r["method"]] = r
    drafters = [m for m in ("std", "sparrow") if any(m in rows for rows in by_len.values())]
    head = "| visual tokens | vanilla step |"
    rule = "|---:|---:|"
    for m in drafters:
        head += f" {m}: draft step x drafts/cycle | {m} verify |"
        head += " std gather (once per prompt) |" if m == "std" else ""
        head += f" {m} cycle | {m} tokens/cycle |"
        rule += "---:|---:|" + ("---:|" if m == "std" else "") + "---:|---:|"
    lines = [head, rule]
    for n, rows in sorted(by_len.items()):
        cells = [str(n), _ms(rows.get("vanilla", {}).get("step_s"))]
        for m in drafters:
            r = rows.get(m, {})
            cells.append(f"{_ms(r.get('draft_step_s'))} x {_f(r.get('draft_tokens_per_cycle'), '.1f')}")
            cells.append(_ms(r.get("verify_s")))
            if m == "std":
                cells.append(_ms(r.get("gather_s")))
            cells += [_ms(r.get("step_s")), _f(r.get("mean_accepted_length"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def spread_table(doc: dict) -> list[str]:
    by_len: dict[int, dict[str, dict]] = {}
    for r in doc["results"]:
        by_len.setdefault(r["visual_tokens"], {})[r["method"]] = r
    methods = [m for m in ("std", "sparrow", "auto") if any(m in rows for rows in by_len.values())]
    lines = [
        "| visual tokens | "
        + " | ".join(f"{m}: speedup per repeat, min - median - max" for m in methods)
        + " |",
        "|---:|" + "---:|" * len(methods),
    ]
    for n, rows in sorted(by_len.items()):
        cells = [str(n)]
        for m in methods:
            ratios = sorted(per_repeat_speedups(rows.get(m, {}), rows.get("vanilla")))
            mid = statistics.median(ratios) if ratios else 0.0
            cells.append(f"{ratios[0]:.2f} - {mid:.2f} - {ratios[-1]:.2f}" if ratios else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--cycles", action="store_true")
    p.add_argument("--spread", action="store_true")
    args = p.parse_args()
    doc = json.loads(args.json.read_text())
    if args.cycles:
        print("\n".join(cycles_table(doc)))
    elif args.spread:
        print("\n".join(spread_table(doc)))
    else:
        print(format_table(doc))


if __name__ == "__main__":
    main()
