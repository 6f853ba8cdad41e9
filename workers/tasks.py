"""The plain data a dispatcher hands to the workers: which video, which task, how to decode.

Contract: frozen, validated dataclasses with no heavy imports (no torch, Ray or PyAV at import time), so
producers and the job schema can use them cheaply. `VideoSource.key` names the cached visual session: the
same video (its `video_id`, else its URI) sampled the same way shares one session.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoders.sampling import DecodeConfig

CAPTION_PROMPT = "describe the video ."  # the caption prompt the reference model is trained and scored with
TASK_TYPES = ("caption", "qa")


@dataclass(frozen=True)
class VideoSource:
    uri: str
    fps: float = 2.0
    max_frames: int = 768
    video_id: str | None = None  # a caller's name for the video; defaults to the URI

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri.strip():
            raise ValueError("VideoSource.uri must be a non-empty string")
        if isinstance(self.fps, bool) or not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"VideoSource.fps must be > 0, got {self.fps!r}")
        if isinstance(self.max_frames, bool) or not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"VideoSource.max_frames must be an int >= 1, got {self.max_frames!r}")

    @property
    def key(self) -> str:
        """Same video and same sampling -> same visual KV. (A changed file needs a new name or id.)"""
        ident = json.dumps([self.video_id or self.uri, float(self.fps), int(self.max_frames)])
        return hashlib.sha256(ident.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class TaskInput:
    type: str  # "caption" | "qa"
    question: str | None = None

    def __post_init__(self) -> None:
        if self.type not in TASK_TYPES:
            raise ValueError(f"task type must be one of {TASK_TYPES}, got {self.type!r}")
        if self.type == "qa" and not (self.question and self.question.strip()):
            raise ValueError("a qa task needs a non-empty question")
        if self.type == "caption" and self.question is not None:
            raise ValueError("a caption task takes no question")

    @property
    def prompt(self) -> str:
        return CAPTION_PROMPT if self.type == "caption" else str(self.question)


@dataclass(frozen=True)
class DecodeInput:
    method: str = "auto"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks and tests on random-weight models only

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"DecodeInput.method must be a method name, got {self.method!r}")

    def config(self) -> DecodeConfig:
        from decoders.sampling import DecodeConfig

        return DecodeConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )
