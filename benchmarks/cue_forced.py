"""How well does a cued two-turn model (``--qa-turns --qa-cue``) read its list when its cue is right?

``vidspec eval`` lets the model write its own cue (``world.cued_answer``: ``square . red``), so a wrong answer may
come from a cue copied wrong from the question or from a lookup gone wrong in the list. This diagnostic asks
every cued question of the eval's held-out videos twice after the model's own object list: once as ``eval``
does, and once with the right cue and `` . `` already written at the start of the reply (appended to the
prompt, so the model writes only the answer). Per question type: the cue repeated right, the answer right,
and the answer right with the cue forced; also split by whether the model's list was right in colour and shape.

    python benchmarks/cue_forced.py --model runtime/v12-export --videos 24 --json out.json
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


def colour_shape(object_list: str) -> list[str]:
    """The ``<colour> <shape>`` of each item of an object list (its directions dropped)."""
    return [" ".join(item.split()[:2]) for item in object_list.split(" , ")]


def forced_prompt(lm: object, listed: str, qa: W.QA) -> list[int]:
    """The two-turn prompt of ``qa`` with the reply started by its right cue and `` . ``."""
    return lm.suffix_ids(after_list(listed, qa.question)) + lm.encode_text(f"{qa.cue} .")


def summarise(rows: list[dict]) -> dict:
    """Per question type (and ``all``): the cue repeated right, the answer right, the answer right with the
    cue forced."""
    return common.count_by_qtype(
        rows,
        {
            "cue_right": lambda r: r["cue_right"],
            "answer_right": lambda r: r["answer_right"],
            "answer_right_cue_forced": lambda r: r["forced_right"],
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = common.held_out_parser(__doc__, "runtime/cue-forced").parse_args(argv)

    import torch

    from decoders.engine import run
    from decoders.model import load_model
    from decoders.sampling import DecodeConfig

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device="cpu")
    cfg = DecodeConfig(max_new_tokens=16)
    rows: list[dict] = []
    for seed, world, session in common.held_out_sessions(lm, args.length, args.videos, args.work_dir):
        listed = ask_object_list(lm, session)
        list_right = colour_shape(listed) == colour_shape(W.object_list(world))
        for qa in eval_questions(world, seed):
            if not qa.cue:
                continue
            reply = " ".join(run(session, lm.suffix_ids(after_list(listed, qa.question)), cfg).text.split())
            forced = " ".join(run(session, forced_prompt(lm, listed, qa), cfg).text.split())
            rows.append(
                {
                    "seed": seed,
                    "qtype": qa.qtype,
                    "question": qa.question,
                    "answer": qa.answer,
                    "reply": reply,
                    "forced_reply": forced,
                    "cue_right": reply.rpartition(" . ")[0] == qa.cue,
                    "answer_right": W.final_answer(reply) == qa.answer,
                    "forced_right": forced == qa.answer,
                    "list_right": list_right,
                }
            )
        print(f"seed {seed}: list right {list_right}", flush=True)
    out = {
        "model": args.model,
        "length": args.length,
        "videos": args.videos,
        "all_lists": summarise(rows),
        "right_lists": summarise([r for r in rows if r["list_right"]]),
        "records": rows,
    }
    print(json.dumps({k: out[k] for k in ("all_lists", "right_lists")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
