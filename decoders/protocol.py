"""How a checkpoint expects to be asked: directly, or in two turns after its own object list.

A model trained with two-turn QA (``vidspec train-reference --qa-turns``; ``training_info.json`` records
``config.qa_turns``) is first asked ``LIST_PROMPT`` about the video and then each question in a second user
turn after its own reply (``after_list``). The list is generated once per video and reused by every question
(``vidspec eval`` and the video worker both do so). Captions are asked directly, unless the model was trained
to caption after its list too (``--caption-turns``; ``captions_after_list``). A model trained with
``--qa-cue`` as well first repeats the question's cue in its reply (``square . red``); every reader of a reply
takes its final answer (``world.final_answer``), so nothing here depends on it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

LIST_PROMPT = "which objects appear ?"
LIST_MAX_TOKENS = 160  # an object list of the world's 10 objects at most is 40 tokens


def after_list(object_list: str, question: str) -> str:
    """The text that ``VideoLM.suffix_ids`` turns into a two-turn prompt: ``LIST_PROMPT``, the assistant's
    object list, then ``question`` in a new user turn (the assistant header after it comes from ``suffix_ids``)."""
    return f"{LIST_PROMPT}<|im_end|>\n<|im_start|>assistant\n{object_list}<|im_end|>\n<|im_start|>user\n{question}"


def ask_object_list(
    lm: object, session: object, max_new_tokens: int = LIST_MAX_TOKENS, proposer: object = None
) -> str:
    """The first turn of two-turn QA: the model's greedy reply to ``LIST_PROMPT`` on ``session``, whitespace
    normalised (what ``after_list`` puts back into the prompt)."""
    from decoders.engine import run
    from decoders.sampling import DecodeConfig

    out = run(session, lm.suffix_ids(LIST_PROMPT), DecodeConfig(max_new_tokens), proposer)
    return " ".join(out.text.split())


def _trained_config(model_dir: str | os.PathLike[str] | None) -> dict:
    if model_dir is None:
        return {}
    info = Path(model_dir) / "training_info.json"
    if not info.is_file():
        return {}
    return json.loads(info.read_text()).get("config", {})


def trained_with_turns(model_dir: str | os.PathLike[str] | None) -> bool:
    """Whether the checkpoint was trained with two-turn QA (``training_info.json``'s ``config.qa_turns``)."""
    return bool(_trained_config(model_dir).get("qa_turns", False))


def captions_after_list(model_dir: str | os.PathLike[str] | None) -> bool:
    """Whether the checkpoint's last training run asked captions after the list turn (``config.caption_turns``
    above 0, with ``qa_turns``): it is then asked for captions that way too."""
    cfg = _trained_config(model_dir)
    return bool(cfg.get("qa_turns", False)) and float(cfg.get("caption_turns", 0.0)) > 0
