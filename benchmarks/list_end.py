"""Does a two-turn model end its object list where the video's objects end?

Most wrong short lists of v25 and v27 (session 48) are the true list with its last item repeated: the model
writes `,` where the list should end. This diagnostic teacher-forces the world's list (`world.object_list`)
after the list prompt on held-out clips (seeds as `vision_probe`'s, never trained on) and reads the model's
next-token distribution at two kinds of decision:

- `end`: after the last item, where `<|im_end|>` is due: how often it is the argmax (`end_right`), and its
  mean probability (`p_end`);
- `go_on`: after every other item, where `,` is due: how often `,` is the argmax (`go_on_right`).

Several models are read on the same clips, side by side.

    python benchmarks/list_end.py --model runtime/v27-export --model runtime/v28-export --videos 48
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from vision_probe import PROBE_SEED0, prefix_inputs

from decoders.model import load_model
from decoders.protocol import LIST_PROMPT
from decoders.train import reference as R
from decoders.train import world as W


def list_decisions(lm: object, sample: R.Sample) -> dict:
    """The model's choices at the decisions of the teacher-forced true list of ``sample``."""
    from transformers import DynamicCache

    text = lm.text_model
    emb, pos, next_pos, _, _ = prefix_inputs(lm, sample)
    cache = DynamicCache(config=lm.model.config.text_config)
    text(inputs_embeds=emb, position_ids=pos, cache=cache, use_cache=True)
    listed = lm.encode_text(W.object_list(sample.world))
    ids = lm.suffix_ids(LIST_PROMPT) + listed
    spos = torch.arange(next_pos, next_pos + len(ids))[None, None].expand(3, 1, -1)
    suf = text(inputs_embeds=lm.embed(torch.tensor([ids])), position_ids=spos, cache=cache, use_cache=True)
    probs = torch.softmax(lm.lm_head(suf.last_hidden_state[0]).float(), dim=-1)
    start = len(ids) - len(listed)  # suffix index of the list's first token
    comma = lm.tokenizer.convert_tokens_to_ids(",")
    end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # a comma at list index k is due where position start + k - 1 predicts it; the end after the last token
    go_on = [bool(probs[start + k - 1].argmax() == comma) for k, t in enumerate(listed) if t == comma]
    last = probs[len(ids) - 1]
    return {
        "items": len(sample.world.events),
        "end_right": bool(last.argmax() == end),
        "p_end": float(last[end]),
        "go_on": go_on,
    }


def read(model_dir: str, videos: int, frames: int) -> dict:
    lm = load_model(model_dir, device="cpu")
    rows = []
    with torch.no_grad():
        for i in range(videos):
            rng = np.random.default_rng(PROBE_SEED0 + i)
            s = R.make_sample(lm, rng, frames, 2.0, R.FRAME_SIDE, codec=True)
            if s.world.events:
                rows.append(list_decisions(lm, s))
    go_on = [x for r in rows for x in r["go_on"]]
    return {
        "model": model_dir,
        "videos": len(rows),
        "frames_per_video": frames,
        "end_right": round(float(np.mean([r["end_right"] for r in rows])), 3),
        "p_end": round(float(np.mean([r["p_end"] for r in rows])), 3),
        "go_on_right": round(float(np.mean(go_on)), 3) if go_on else None,
        "go_on_decisions": len(go_on),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, help="checkpoint dir (repeatable)")
    p.add_argument("--videos", type=int, default=48)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = [read(m, args.videos, args.frames) for m in args.model]
    for r in results:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
