"""Choosing a drafter per request: one place that maps a method name to a `Proposer`.

Contract: `make_proposer(method, session)` returns None for "vanilla" (the engine then decodes one token
per step) or a fresh proposer for one prompt. "auto" picks by visual length between the drafters available
for the model; until a Sparrow draft head exists for it, "auto" is StD. `LOSSLESS_METHODS` may be chosen
by "auto"; lossy ones (LVSpec) only when asked for by name.
"""

from __future__ import annotations

from decoders.engine import Proposer
from decoders.proposers.std import StDConfig, StDProposer
from decoders.session import VisualSession

LOSSLESS_METHODS = ("vanilla", "std", "auto")
METHODS = LOSSLESS_METHODS


def resolve_method(method: str, session: VisualSession) -> str:
    """The concrete method "auto" stands for on this session (others map to themselves)."""
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose from {list(METHODS)}")
    if method == "auto":
        return "std"
    return method


def make_proposer(method: str, session: VisualSession, std: StDConfig | None = None) -> Proposer | None:
    concrete = resolve_method(method, session)
    if concrete == "vanilla":
        return None
    return StDProposer(std)
