"""Choosing a drafter per request: the one place that maps a method name to a `Proposer`.

Contract:
- `make_proposer(method, session)` returns None for "vanilla" (the engine then decodes one token per step)
  or a fresh proposer for one prompt.
- "auto" (lossless only): Sparrow below a visual-length threshold and StD at or above it, when a Sparrow
  draft head exists beside the model; StD otherwise. The threshold is measured by a `vidspec bench` sweep
  (`--write-router`) and stored beside the model in `sparrow/router.json`, never hard-coded; with a head
  but no calibration, "auto" uses Sparrow (its cost does not grow with the video).
- The crossover depends on the CPU threads a decode runs on (on 2 threads the native stack splits every
  step, which moves Sparrow's and StD's costs differently), so the file keeps one threshold per thread count
  calibrated (`by_threads`); a session uses the entry for `torch.get_num_threads()`, else the nearest count
  below it, else the nearest above. The top-level `threshold_visual_tokens` / `evidence` are the one-thread
  entry's when there is one (else the latest calibration's): what a reader of the earlier format finds.
- On another device (a GPU) the costs have nothing to do with CPU threads: a calibration run there is kept
  per device type (`by_device`, e.g. "cuda") and a session on that device uses it; without one it falls back
  to the CPU entries.
- Lossy methods (LVSpec, `LOSSY_METHODS`) are only used when asked for by name, never by "auto"; their
  proposer's name starts with "lvspec:" so results and metrics label the answer as lossy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from decoders.engine import Proposer
from decoders.model import VideoLM
from decoders.proposers.lvspec import LVSpecProposer
from decoders.proposers.sparrow import SparrowHead, SparrowProposer, head_path, load_head
from decoders.proposers.std import StDConfig, StDProposer
from decoders.session import VisualSession

LOSSLESS_METHODS = ("vanilla", "std", "sparrow", "auto")
LOSSY_METHODS = ("lvspec",)
METHODS = LOSSLESS_METHODS + LOSSY_METHODS


@dataclass(frozen=True)
class LVSpecSettings:
    base: str = "std"  # the drafter under the loose verifier: "std" or "sparrow"
    lam: float = 0.5
    relevance_threshold: float = 0.3
    shift_window: int = 0
    top_n: int = 10
    representation: str = "input"

    def __post_init__(self) -> None:
        if self.base not in ("std", "sparrow"):
            raise ValueError(f"lvspec base must be std or sparrow, got {self.base!r}")


ROUTER_FILE = "router.json"

_heads: dict[int, SparrowHead | None] = {}


def draft_head(lm: VideoLM) -> SparrowHead | None:
    """The Sparrow head shipped beside `lm`'s checkpoint, loaded once per model; None if there is none."""
    key = id(lm.model)
    if key not in _heads:
        _heads[key] = load_head(lm.path, lm) if (head_path(lm.path) / "model.safetensors").is_file() else None
    return _heads[key]


def _router_doc(model_dir: str | Path) -> dict:
    """`router.json` beside the model's draft head, or {} when there is none."""
    p = head_path(model_dir) / ROUTER_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def router_thresholds(model_dir: str | Path) -> dict[int, int]:
    """Thread count -> calibrated threshold from `router.json` ({} when there is no calibration). A file
    written before `by_threads` existed counts as a one-thread calibration (the bench's setting then)."""
    doc = _router_doc(model_dir)
    by = doc.get("by_threads")
    if not by:
        if "threshold_visual_tokens" not in doc:  # calibrated on a GPU only (`by_device`): none for the CPU
            return {}
        return {int(doc.get("threads", 1)): int(doc["threshold_visual_tokens"])}
    return {int(t): int(entry["threshold_visual_tokens"]) for t, entry in by.items()}


def device_threshold(model_dir: str | Path, device_type: str) -> int | None:
    """The threshold calibrated on `device_type` ("cuda", ...) from `router.json`'s `by_device`, or None."""
    entry = (_router_doc(model_dir).get("by_device") or {}).get(device_type)
    return None if entry is None else int(entry["threshold_visual_tokens"])


def router_threshold(lm: VideoLM, threads: int | None = None) -> int | None:
    """The threshold for `lm`'s device: its own calibration off the CPU, else the one for `threads` CPU
    threads (default: torch's current count); see the module docstring."""
    if lm.device.type != "cpu":
        own = device_threshold(lm.path, lm.device.type)
        if own is not None:
            return own
    table = router_thresholds(lm.path)
    if not table:
        return None
    want = threads if threads is not None else torch.get_num_threads()
    below = [t for t in table if t <= want]
    return table[max(below)] if below else table[min(table)]


def write_router(
    model_dir: str | Path, threshold: int, evidence: dict, threads: int = 1, device: str = "cpu"
) -> Path:
    """Store the calibration of `threads` CPU threads (or of a `device` other than the CPU), keeping the
    other entries."""
    p = head_path(model_dir) / ROUTER_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    old = _router_doc(model_dir)
    entry = {"threshold_visual_tokens": int(threshold), "evidence": evidence}
    if device != "cpu":
        doc = dict(old)
        doc["by_device"] = {**(old.get("by_device") or {}), device: entry}
        p.write_text(json.dumps(doc, indent=2))
        return p
    by = dict(old.get("by_threads") or {})
    if not by and "threshold_visual_tokens" in old:  # the earlier format: a one-thread calibration
        by[str(old.get("threads", 1))] = {
            "threshold_visual_tokens": int(old["threshold_visual_tokens"]),
            "evidence": old.get("evidence", {}),
        }
    by[str(int(threads))] = entry
    top = by.get("1", entry)
    doc = {
        "threshold_visual_tokens": top["threshold_visual_tokens"],
        "evidence": top["evidence"],
        "by_threads": by,
    }
    if old.get("by_device"):
        doc["by_device"] = old["by_device"]
    p.write_text(json.dumps(doc, indent=2))
    return p


def resolve_method(method: str, session: VisualSession) -> str:
    """The concrete method `method` stands for on this session."""
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose from {list(METHODS)}")
    if method != "auto":
        return method
    if draft_head(session.lm) is None:
        return "std"
    threshold = router_threshold(session.lm)
    if threshold is None or session.num_visual_tokens < threshold:
        return "sparrow"
    return "std"


def make_proposer(
    method: str,
    session: VisualSession,
    std: StDConfig | None = None,
    sparrow_gamma: int = 6,
    lvspec: LVSpecSettings | None = None,
    sparrow_native: bool = True,
) -> Proposer | None:
    concrete = resolve_method(method, session)
    if concrete == "vanilla":
        return None
    if concrete == "lvspec":
        opts = lvspec or LVSpecSettings()
        inner = make_proposer(
            opts.base, session, std=std, sparrow_gamma=sparrow_gamma, sparrow_native=sparrow_native
        )
        assert inner is not None
        return LVSpecProposer(
            inner,
            lam=opts.lam,
            relevance_threshold=opts.relevance_threshold,
            shift_window=opts.shift_window,
            top_n=opts.top_n,
            representation=opts.representation,
        )
    if concrete == "sparrow":
        head = draft_head(session.lm)
        if head is None:
            raise ValueError(
                f"no Sparrow draft head beside {session.lm.path} (train one with `vidspec train-draft`)"
            )
        proposer: Proposer = SparrowProposer(head, gamma=sparrow_gamma, native=sparrow_native)
    else:
        proposer = StDProposer(std)
    proposer.name = concrete if method != "auto" else f"auto:{concrete}"  # type: ignore[misc]
    return proposer
