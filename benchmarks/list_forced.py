"""Does a two-turn model (``--qa-turns``) answer from the object list in its first turn?

``benchmarks/cue_forced.py`` shows whether the answer depends on the cue a cued reply repeats; it cannot show
whether the answer is read from the list, since the question holds the cue as well. This diagnostic asks every
lookup question (``LIST_LOOKUP_QTYPES``, one object) of the eval's held-out videos after three first turns,
each written into the prompt in place of the model's own reply:

- ``own``: the model's own list (as ``vidspec eval`` asks);
- ``true``: the world's list (``world.object_list``): how well the model answers from a right list;
- ``altered``: the world's list with the answer's word of the looked-up item replaced by another value
  (``counterfactual_list``), so that the list and the video disagree. ``follows_list`` counts replies with the
  list's new value, ``follows_video`` replies with the video's (the old) one.

A model that reads its list follows the altered list; one that answers from the video keeps the old answer.

    python benchmarks/list_forced.py --model runtime/v14-export --videos 24 --json out.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)

from decoders.protocol import after_list, ask_object_list
from decoders.train import world as W
from decoders.train.eval import eval_questions
from decoders.train.reference import LIST_LOOKUP_QTYPES


def counterfactual_list(world: W.WorldSpec, qa: W.QA) -> tuple[str, str] | None:
    """The world's object list with ``qa``'s answer changed in the item it is read from, and the new answer.

    The answer's word (a colour, a shape or a direction; of a ``<colour> <shape>`` answer, the colour) is
    replaced by the first value of its kind, in vocabulary order, that differs from it and that no other object
    of the list has (a colour or shape no other object has keeps the question's object unique). None for
    questions that are not one-object lookups, or when no such value exists."""
    if qa.qtype not in LIST_LOOKUP_QTYPES or len(qa.refs) != 1 or not world.events:
        return None
    items = [W.item_text(e).split() for e in world.events]
    k = qa.refs[0]
    words = qa.answer.split()
    kinds = {**dict.fromkeys(W.COLOURS, 0), **dict.fromkeys(W.SHAPES, 1), **dict.fromkeys(W.DIRECTIONS, 2)}
    col = 0 if len(words) == 2 else kinds.get(words[0])
    if col is None or items[k][col] != words[0]:
        return None
    vocab = (tuple(W.COLOURS), W.SHAPES, W.DIRECTIONS)[col]
    taken = {it[col] for j, it in enumerate(items) if j != k} if col < 2 else set()
    new = next((v for v in vocab if v != items[k][col] and v not in taken), None)
    if new is None:
        return None
    items[k][col] = new
    return " , ".join(" ".join(it) for it in items), " ".join([new, *words[1:]])


def summarise(rows: list[dict]) -> dict:
    """Per question type (and ``all``): answers right after the own and the true list; after the altered list,
    replies with the list's new answer and with the video's old one."""
    return common.count_by_qtype(
        rows,
        {
            "right_own_list": lambda r: r["own_right"],
            "right_true_list": lambda r: r["true_right"],
            "altered": lambda r: r["altered_answer"] is not None,
            "follows_list": lambda r: r["follows_list"],
            "follows_video": lambda r: r["follows_video"],
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = common.held_out_parser(__doc__, "runtime/list-forced").parse_args(argv)

    import torch

    from decoders.engine import run
    from decoders.model import load_model
    from decoders.sampling import DecodeConfig
    from decoders.session import VisualSession

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu")
    cfg = DecodeConfig(max_new_tokens=16)
    rows: list[dict] = []

    def ask(session: VisualSession, listed: str, question: str) -> str:
        reply = " ".join(run(session, lm.suffix_ids(after_list(listed, question)), cfg).text.split())
        return W.final_answer(reply)

    for seed, world, session in common.held_out_sessions(lm, args.length, args.videos, args.work_dir):
        own = ask_object_list(lm, session)
        true = W.object_list(world)
        for qa in eval_questions(world, seed):
            if qa.qtype not in LIST_LOOKUP_QTYPES or len(qa.refs) != 1:
                continue
            alt = counterfactual_list(world, qa)
            got_alt = ask(session, alt[0], qa.question) if alt else None
            rows.append(
                {
                    "seed": seed,
                    "qtype": qa.qtype,
                    "question": qa.question,
                    "answer": qa.answer,
                    "own_list": own,
                    "own_reply": (got_own := ask(session, own, qa.question)),
                    "true_reply": (got_true := ask(session, true, qa.question)),
                    "altered_list": alt[0] if alt else None,
                    "altered_answer": alt[1] if alt else None,
                    "altered_reply": got_alt,
                    "own_right": got_own == qa.answer,
                    "true_right": got_true == qa.answer,
                    "follows_list": alt is not None and got_alt == alt[1],
                    "follows_video": alt is not None and got_alt == qa.answer,
                }
            )
    out = {"model": args.model, "length": args.length, "videos": args.videos, "summary": summarise(rows)}
    out["records"] = rows
    print(json.dumps(out["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
