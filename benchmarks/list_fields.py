"""How right are the object lists a model wrote during `vidspec eval`, field by field?

Reads `vidspec eval` JSON files and scores each video's object list against the world's
(`world.object_list` of the eval's world for that seed) item by item, aligned by position: colour, shape and
direction right, and whether the number of items is right. A two-turn model's list is its first turn
(`object_list` of a record); a traced model's lists are the part of each traced reply before its last ` . `
(one per traced question). Directions are only scored on items whose colour and shape are right; a confusion
table of (true, written) directions is given for them.

    python benchmarks/list_fields.py benchmarks/results/reference-v18-eval.json --length short
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoders.train import world as W
from decoders.train.eval import SETTINGS, eval_world


def score_list(written: str, true: str) -> dict:
    """Counts of one written list against the true one (``"<colour> <shape> <direction> , ..."``): ``items``
    (true items that have a written item at the same place), per field the items right (``direction`` only
    where colour and shape are right: ``directed``), ``length_right``, and the ``(true, written)`` directions."""
    got = [x.split() for x in written.split(" , ")] if written.strip() else []
    want = [x.split() for x in true.split(" , ")] if true.strip() else []
    out: dict = {"items": 0, "colour": 0, "shape": 0, "directed": 0, "direction": 0}
    confusion: Counter = Counter()
    for g, t in zip(got, want, strict=False):
        out["items"] += 1
        g = [*g, "", "", ""][:3]
        out["colour"] += g[0] == t[0]
        out["shape"] += g[1] == t[1]
        if g[:2] == t[:2]:
            out["directed"] += 1
            out["direction"] += g[2] == t[2]
            confusion[(t[2], g[2])] += 1
    out["length_right"] = len(got) == len(want)
    out["confusion"] = confusion
    return out


def written_lists(record: dict) -> list[str]:
    """The object lists one eval record holds: a two-turn record's first turn; a traced reply's list."""
    if record.get("object_list") is not None:
        return [record["object_list"]]
    reply = record.get("reply") or ""
    return [reply.rsplit(" . ", 1)[0]] if " . " in reply else []


def collect(records: list[dict], length: str) -> dict:
    """Totals over the records of ``length``: a two-turn list once per video, a traced list once per reply."""
    totals: Counter = Counter()
    confusion: Counter = Counter()
    seen: set[int] = set()
    for r in records:
        if r.get("length") != length:
            continue
        two_turn = r.get("object_list") is not None
        if two_turn and r["seed"] in seen:
            continue
        lists = written_lists(r)
        if not lists:
            continue
        seen.add(r["seed"])
        true = W.object_list(eval_world(SETTINGS[length], r["seed"]))
        for written in lists:
            sc = score_list(written, true)
            confusion.update(sc.pop("confusion"))
            totals.update({k: int(v) for k, v in sc.items()})
            totals["lists"] += 1
    return {
        **dict(totals),
        "videos": len(seen),
        "direction_confusion": {f"{t}->{g}": n for (t, g), n in sorted(confusion.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("evals", nargs="+", help="vidspec eval JSON files")
    p.add_argument("--length", default="short", choices=sorted(SETTINGS))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    out = {}
    for path in args.evals:
        doc = json.loads(Path(path).read_text())
        out[path] = {"model": doc.get("model"), **collect(doc["records"], args.length)}
        r = out[path]
        print(
            f"{path}: {r.get('lists', 0)} lists of {r['videos']} videos, {r.get('length_right', 0)} of the right "
            f"length; items {r.get('items', 0)}: colour {r.get('colour', 0)}, shape {r.get('shape', 0)}, "
            f"direction {r.get('direction', 0)} of {r.get('directed', 0)} with colour and shape right"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
