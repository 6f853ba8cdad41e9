"""Which part of a traced reply is wrong: the cue, the object, its direction, the running count or the stop.

Reads a ``vidspec eval`` JSON (its records hold every reply), rebuilds each held-out world from its seed and
compares each item of a scan trace (``world.scan_list`` / ``world.cued_scan``) with the world's event at the
same position. Counts over the traced question types at one length:

- ``items``: trace items written; ``cue_right``: items that start with the question's cue (cued traces only);
- ``colour_shape_right`` / ``dir_right`` / ``obj_right``: items whose object matches the event at that
  position in colour and shape / in direction / in all three (items past the last event are not compared);
- ``count_word_right`` of ``count_items``: running count words that match the world's (filtered counts);
- ``lookup_len_right`` of ``lookups``: lookups whose trace stops at the object the question names.

Usage: ``python benchmarks/trace_parts.py EVAL.json [--length short] [--uncued] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import collections
import json

from decoders.train import world as W
from decoders.train.eval import SETTINGS, eval_questions, eval_world


def trace_parts(records: list[dict], length: str, cued: bool) -> dict[str, int]:
    setting = SETTINGS[length]
    worlds: dict[int, tuple[W.WorldSpec, dict[str, W.QA]]] = {}
    st: collections.Counter[str] = collections.Counter()
    for r in records:
        if r["length"] != length or r["qtype"] not in W.TRACED_QTYPES:
            continue
        seed = r["seed"]
        if seed not in worlds:
            w = eval_world(setting, seed)
            worlds[seed] = (w, {q.question: q for q in eval_questions(w, seed)})
        w, qas = worlds[seed]
        qa = qas[r["question"]]
        trace, sep, _ = r["reply"].rpartition(" . ")  # eval stores replies whitespace-normalised
        if not sep:
            continue
        items = trace.split(" , ")
        cue = qa.cue.split() if cued else []
        gold = W.cued_scan(w, qa).split(" , ") if cued else W.scan_list(w, qa).split(" , ")
        counting = qa.qtype in W.COUNTING_QTYPES
        for i, item in enumerate(items):
            words = item.split()
            st["items"] += 1
            if cued:
                st["cue_right"] += words[: len(cue)] == cue
            if i < len(w.events):
                obj, want = words[len(cue) : len(cue) + 3], W.item_text(w.events[i]).split()
                st["colour_shape_right"] += obj[:2] == want[:2]
                st["dir_right"] += obj[2:3] == want[2:3]
                st["obj_right"] += obj == want
            if counting and i < len(gold):
                st["count_items"] += 1
                st["count_word_right"] += words[-1:] == gold[i].split()[-1:]
        if not counting:
            st["lookups"] += 1
            st["lookup_len_right"] += len(items) == len(gold)
    return dict(st)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("eval_json")
    p.add_argument("--length", default="short", choices=sorted(SETTINGS))
    p.add_argument("--uncued", action="store_true", help="the replies are scan traces without a cue")
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args()
    with open(args.eval_json) as f:
        records = json.load(f)["records"]
    counts = trace_parts(records, args.length, cued=not args.uncued)
    print(json.dumps(counts, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"eval": args.eval_json, "length": args.length, "cued": not args.uncued, **counts},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
