"""The job request (DESIGN.md contract), validated with errors that say where and what is wrong.

Contract:
```
{"job_id"?: str,
 "video": {"uri": str, "id"?: str},
 "tasks": [{"type": "caption"} | {"type": "qa", "question": str}, ...],
 "decoding"?: {"method": "auto|std|sparrow|vanilla|lvspec", "max_new_tokens": int, "temperature": float,
               "top_p"?: float, "seed"?: int, "ignore_eos"?: bool},
 "sampling"?: {"fps": float, "max_frames": int},
 "timeout_s"?: float}
```
- `parse_request(obj)` accepts a dict or a JSON string and returns a frozen `JobRequest`, or raises
  `RequestError` (a `ValueError`) naming the field path (`tasks[1].question`) and what is allowed.
  Unknown fields are errors (a typo must not be silently ignored). `job_id` is generated when absent.
- `video.uri` is an absolute path, a `file://` URI or an `http(s)://` URL; whether the service accepts it
  is the input policy's decision at ingest time (workers/ingest.py), not the schema's.
- `method` names any method of the contract; a method the worker's model cannot run yet fails the job
  with the router's message. Additions beyond the contract (`video.id`, `top_p`, `seed`, `ignore_eos`,
  `timeout_s`) are optional; `ignore_eos` exists for benchmarks on random-weight models.
- `JobRequest.to_json()` is the canonical form stored in Redis; parsing it gives the same request.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from infra.queue import InvalidJobId, new_job_id, validate_job_id
from workers.tasks import TASK_TYPES, DecodeInput, TaskInput, VideoSource

METHODS = ("auto", "std", "sparrow", "vanilla", "lvspec")
MAX_TASKS = 32
MAX_NEW_TOKENS = 1024
MAX_QUESTION_CHARS = 1000
MAX_URI_CHARS = 4096
DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 768


class RequestError(ValueError):
    """A job request that does not follow the contract; the message names the field."""


@dataclass(frozen=True)
class JobRequest:
    job_id: str
    video: VideoSource
    tasks: tuple[TaskInput, ...]
    decoding: DecodeInput
    timeout_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        video: dict[str, Any] = {"uri": self.video.uri}
        if self.video.video_id is not None:
            video["id"] = self.video.video_id
        tasks = [
            {"type": t.type} if t.type == "caption" else {"type": t.type, "question": t.question}
            for t in self.tasks
        ]
        d = self.decoding
        decoding: dict[str, Any] = {
            "method": d.method,
            "max_new_tokens": d.max_new_tokens,
            "temperature": d.temperature,
            "top_p": d.top_p,
        }
        if d.seed is not None:
            decoding["seed"] = d.seed
        if d.ignore_eos:
            decoding["ignore_eos"] = True
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "video": video,
            "tasks": tasks,
            "decoding": decoding,
            "sampling": {"fps": self.video.fps, "max_frames": self.video.max_frames},
        }
        if self.timeout_s is not None:
            out["timeout_s"] = self.timeout_s
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _fields(obj: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise RequestError(f"{path}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise RequestError(f"{path}: unknown field(s) {unknown}; allowed: {list(allowed)}")
    for name in required:
        if name not in obj:
            raise RequestError(f"{path}.{name}: required")
    return obj


def _int(v: Any, path: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{path}: expected an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(f"{path}: must be {bound}, got {v}")
    return v


def _num(v: Any, path: str, lo: float, hi: float | None = None, open_lo: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RequestError(f"{path}: expected a finite number, got {v!r}")
    if (v <= lo if open_lo else v < lo) or (hi is not None and v > hi):
        left = "(" if open_lo else "["
        raise RequestError(f"{path}: must be in {left}{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return float(v)


def _str(v: Any, path: str, max_chars: int) -> str:
    if not isinstance(v, str) or not v.strip():
        raise RequestError(f"{path}: expected a non-empty string, got {v!r}")
    if len(v) > max_chars:
        raise RequestError(f"{path}: at most {max_chars} characters, got {len(v)}")
    return v


def _uri(v: Any) -> str:
    uri = _str(v, "video.uri", MAX_URI_CHARS).strip()
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme in ("http", "https"):
        if not urllib.parse.urlsplit(uri).netloc:
            raise RequestError(f"video.uri: {uri!r} has no host")
        return uri
    if scheme == "file":
        return uri
    if scheme:
        raise RequestError(
            f"video.uri: scheme {scheme!r} is not supported; use an absolute path, file:// or http(s)://"
        )
    if not uri.startswith("/"):
        raise RequestError(
            f"video.uri: {uri!r} is a relative path; give an absolute path (the service has its own cwd)"
        )
    return uri


def parse_request(obj: dict[str, Any] | str | bytes) -> JobRequest:
    if isinstance(obj, str | bytes):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as exc:
            raise RequestError(f"request is not valid JSON: {exc}") from None
    top = _fields(
        obj, "request", ("job_id", "video", "tasks", "decoding", "sampling", "timeout_s"), ("video", "tasks")
    )
    job_id = top.get("job_id")
    if job_id is None:
        job_id = new_job_id()
    else:
        try:
            validate_job_id(job_id)
        except InvalidJobId as exc:
            raise RequestError(f"job_id: {exc}") from None

    video = _fields(top["video"], "video", ("uri", "id"), ("uri",))
    uri = _uri(video["uri"])
    video_id = _str(video["id"], "video.id", 256) if "id" in video else None

    sampling = _fields(top.get("sampling", {}), "sampling", ("fps", "max_frames"))
    fps = _num(sampling.get("fps", DEFAULT_FPS), "sampling.fps", 0.0, 60.0, open_lo=True)
    max_frames = _int(sampling.get("max_frames", DEFAULT_MAX_FRAMES), "sampling.max_frames", 4, 16384)

    tasks_raw = top["tasks"]
    if not isinstance(tasks_raw, list) or not tasks_raw:
        raise RequestError(f"tasks: expected a non-empty list of tasks, got {tasks_raw!r}")
    if len(tasks_raw) > MAX_TASKS:
        raise RequestError(f"tasks: at most {MAX_TASKS} tasks per job, got {len(tasks_raw)}")
    tasks = []
    for i, t in enumerate(tasks_raw):
        path = f"tasks[{i}]"
        if not isinstance(t, dict):
            raise RequestError(f'{path}: expected an object like {{"type": "caption"}}, got {t!r}')
        kind = t.get("type")
        if kind not in TASK_TYPES:
            raise RequestError(f"{path}.type: must be one of {list(TASK_TYPES)}, got {kind!r}")
        if kind == "caption":
            _fields(t, path, ("type",))
            tasks.append(TaskInput("caption"))
        else:
            _fields(t, path, ("type", "question"), ("question",))
            tasks.append(TaskInput("qa", _str(t["question"], f"{path}.question", MAX_QUESTION_CHARS).strip()))

    dec = _fields(
        top.get("decoding", {}),
        "decoding",
        ("method", "max_new_tokens", "temperature", "top_p", "seed", "ignore_eos"),
    )
    method = dec.get("method", "auto")
    if method not in METHODS:
        raise RequestError(f"decoding.method: must be one of {list(METHODS)}, got {method!r}")
    ignore_eos = dec.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"decoding.ignore_eos: expected true or false, got {ignore_eos!r}")
    seed = dec.get("seed")
    decoding = DecodeInput(
        method=method,
        max_new_tokens=_int(dec.get("max_new_tokens", 128), "decoding.max_new_tokens", 1, MAX_NEW_TOKENS),
        temperature=_num(dec.get("temperature", 0.0), "decoding.temperature", 0.0, 10.0),
        top_p=_num(dec.get("top_p", 1.0), "decoding.top_p", 0.0, 1.0, open_lo=True),
        seed=None if seed is None else _int(seed, "decoding.seed", 0, 2**62),
        ignore_eos=ignore_eos,
    )
    timeout = top.get("timeout_s")
    timeout_s = None if timeout is None else _num(timeout, "timeout_s", 0.0, 7 * 24 * 3600.0, open_lo=True)
    return JobRequest(
        job_id=job_id,
        video=VideoSource(uri=uri, fps=fps, max_frames=max_frames, video_id=video_id),
        tasks=tuple(tasks),
        decoding=decoding,
        timeout_s=timeout_s,
    )


def build_request(
    uri: str,
    tasks: list[dict[str, Any]],
    *,
    job_id: str | None = None,
    method: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    timeout_s: float | None = None,
    ignore_eos: bool = False,
) -> JobRequest:
    """A validated request from CLI-style arguments (None = the contract's default)."""
    obj: dict[str, Any] = {"video": {"uri": uri}, "tasks": tasks}
    if job_id is not None:
        obj["job_id"] = job_id
    decoding = {
        k: v
        for k, v in (("method", method), ("max_new_tokens", max_new_tokens), ("temperature", temperature))
        if v is not None
    }
    if ignore_eos:
        decoding["ignore_eos"] = True
    if decoding:
        obj["decoding"] = decoding
    sampling = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
    if sampling:
        obj["sampling"] = sampling
    if timeout_s is not None:
        obj["timeout_s"] = timeout_s
    return parse_request(obj)
