"""The video worker: holds the model, keeps one `VisualSession` (prefilled visual KV) per video, and answers
every task on that video with speculative decoding.

Contract:
- `VideoWorkerCore.open_video(source, ingested)` makes sure the session of `source.key` exists: a hit
  reuses it (no vision tower, no prefill); a miss builds it from `ingested` (or, if that is None, from its
  `ingest` fallback) and reports the ingest, vision-tower and prefill seconds spent for this call.
- `answer(job_id, source, task, decoding, ...)` decodes one task on the video's session with the proposer
  the router picks (`decoders.proposers.router.make_proposer`; unknown or unavailable methods raise
  `ValueError`) and returns a `TaskResult`: text, tokens, concrete method, `SpecDecodeStats` as a dict,
  time to first token, decode time, tokens per target forward pass. It rebuilds an evicted session first.
  A checkpoint trained with two-turn QA (``decoders.protocol``) is asked each question after its own object
  list, made once per cached video; one trained with ``--caption-turns`` is asked for captions so too.
- Sessions live in an LRU cache bounded by `cache_bytes` (the sum of `session.kv_bytes()`); building or
  growing a session evicts the least recently used others until the sum fits. A single session larger than
  the budget is kept (it is needed now) and is the first to go next time.
- Every `SessionInfo` and `TaskResult` carries `worker_state`, a plain-dict `WorkerState` snapshot taken
  when the call ended (this incarnation's id, a report sequence number, cumulative evictions, cached
  sessions and bytes), so the serving process can keep its metrics without polling a busy actor. A
  `TaskResult` whose call had to rebuild an evicted session also carries `session_built` (frames, visual
  tokens, ingest / vision-tower / prefill seconds of that rebuild; None otherwise).
- `cancel(job_id)` may be called from another thread: the running task of that job stops at its next
  decoded chunk with `JobCancelled`; a task whose deadline (`remaining_s`) passes stops with `JobTimedOut`.
  Either way the session is back at its visual prefix.
- `VideoWorker` is the Ray actor: a thin shell with a `control` concurrency group (cancel, ping) beside the
  serial default group (all model work), so a cancel reaches a busy worker.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray
import torch

from decoders.engine import SpecDecodeStats, generate
from decoders.model import VideoLM, load_model
from decoders.proposers.router import make_proposer, resolve_method
from decoders.proposers.std import StDConfig
from decoders.protocol import (
    LIST_MAX_TOKENS,
    LIST_PROMPT,
    after_list,
    captions_after_list,
    trained_with_turns,
)
from decoders.session import VisualSession
from workers.ingest import IngestedVideo
from workers.tasks import DecodeInput, TaskInput, VideoSource

IngestFn = Callable[[VideoSource], IngestedVideo]


class JobCancelled(RuntimeError):
    """The job was cancelled while this worker was decoding one of its tasks."""


class JobTimedOut(RuntimeError):
    """The job's time limit passed while this worker was decoding one of its tasks."""


class SessionMissing(LookupError):
    """No cached session for the video and no way to ingest it here."""


@dataclass(frozen=True)
class SessionInfo:
    """The video's session as one job sees it. Times are what this call spent (0 on a cache hit)."""

    key: str
    cache: str  # "hit" | "miss"
    visual_tokens: int
    frames: int
    duration_s: float
    ingest_s: float
    encode_s: float  # vision tower
    prefill_s: float  # decoder prefill of the visual prefix
    kv_bytes: int
    cached_videos: int
    cached_bytes: int
    cached_keys: tuple[str, ...] = ()  # every video this worker holds after the call (LRU order)
    worker_state: dict[str, Any] = field(default_factory=dict)  # WorkerState.to_dict() after the call

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TaskResult:
    type: str
    question: str
    text: str
    tokens: list[int]
    num_tokens: int
    method: str  # the concrete method that decoded ("auto" resolved)
    requested_method: str
    stats: dict[str, Any]  # SpecDecodeStats.to_dict()
    ttft_s: float  # prompt-suffix prefill to first token, on the cached session
    decode_s: float  # first token to last
    tokens_per_target_forward: float  # speedup estimate: tokens per forward pass of the target model
    first_token_at: float  # Unix time of the first token
    session_cache: str  # "hit" | "miss" (rebuilt after an eviction)
    worker_state: dict[str, Any] = field(default_factory=dict)  # WorkerState.to_dict() after the call
    # on a miss: frames, visual_tokens, ingest_s, encode_s, prefill_s of the rebuild this call did
    session_built: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class WorkerState:
    """What a worker holds and has evicted, reported with every result (plain data for the metrics).

    `incarnation` changes when the actor restarts (its counters and cache start again from zero);
    `seq` orders the reports of one incarnation; `evictions` is cumulative within an incarnation."""

    incarnation: str
    seq: int
    evictions: int
    cached_videos: int
    cached_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class WorkerStats:
    model: str
    sessions_built: int
    session_hits: int
    evictions: int
    tasks_answered: int
    cached_videos: list[str]
    cached_bytes: int
    budget_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Entry:
    session: VisualSession
    ingested: IngestedVideo
    kv_bytes: int
    uses: int = 0
    # two-turn QA (``decoders.protocol``): the model's own object list, generated once per session
    object_list: str | None = None


@dataclass
class _Cancels:
    """(job id, attempt) pairs cancelled on this worker (thread-safe; the oldest are forgotten past
    `limit`). Per attempt: a job handed back and redelivered must not inherit its old attempt's cancel."""

    limit: int = 10_000
    _ids: set[tuple[str, int]] = field(default_factory=set)
    _order: deque[tuple[str, int]] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, item: tuple[str, int]) -> None:
        with self._lock:
            if item in self._ids:
                return
            self._ids.add(item)
            self._order.append(item)
            while len(self._order) > self.limit:
                self._ids.discard(self._order.popleft())

    def __contains__(self, item: tuple[str, int]) -> bool:
        with self._lock:
            return item in self._ids


class VideoWorkerCore:
    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: str = "auto",
        cache_bytes: int = 4 * 1024**3,
        ingest: IngestFn | None = None,
        std: StDConfig | None = None,
        headroom: int = 1024,
        lm: VideoLM | None = None,
        qa_turns: bool | None = None,
        caption_turns: bool | None = None,
    ) -> None:
        if cache_bytes < 1:
            raise ValueError(f"cache_bytes must be >= 1, got {cache_bytes}")
        self.lm = lm if lm is not None else load_model(model_dir, device=device)
        self.cache_bytes = cache_bytes
        self.ingest = ingest
        self.std = std
        self.headroom = headroom
        # ask questions after the model's own object list, as it was trained (``decoders.protocol``)
        self.qa_turns = trained_with_turns(model_dir) if qa_turns is None else qa_turns
        # and captions after it too when it was trained so (``--caption-turns``)
        self.caption_turns = captions_after_list(model_dir) if caption_turns is None else caption_turns
        self._sessions: OrderedDict[str, _Entry] = OrderedDict()
        self._cancels = _Cancels()
        self.sessions_built = 0
        self.session_hits = 0
        self.evictions = 0
        self.tasks_answered = 0
        self.incarnation = uuid.uuid4().hex[:12]
        self._seq = 0
        self._seq_lock = threading.Lock()

    # -- sessions ---------------------------------------------------------------------------------
    def open_video(self, source: VideoSource, ingested: IngestedVideo | None = None) -> SessionInfo:
        entry, built = self._session(source, ingested)
        ing = entry.ingested
        return SessionInfo(
            key=source.key,
            cache="miss" if built else "hit",
            visual_tokens=entry.session.num_visual_tokens,
            frames=ing.frames,
            duration_s=ing.duration_s,
            ingest_s=ing.ingest_s if built else 0.0,
            encode_s=entry.session.encode_s if built else 0.0,
            prefill_s=entry.session.prefill_s if built else 0.0,
            kv_bytes=entry.kv_bytes,
            cached_videos=len(self._sessions),
            cached_bytes=self.cached_bytes,
            cached_keys=tuple(self._sessions),
            worker_state=self.state().to_dict(),
        )

    def _session(self, source: VideoSource, ingested: IngestedVideo | None) -> tuple[_Entry, bool]:
        key = source.key
        entry = self._sessions.get(key)
        if entry is not None:
            self._sessions.move_to_end(key)
            entry.uses += 1
            self.session_hits += 1
            return entry, False
        if ingested is None:
            if self.ingest is None:
                raise SessionMissing(
                    f"video {source.uri} is not cached on this worker and no ingest is wired"
                )
            ingested = self.ingest(source)
        visual = ingested.visual
        if visual.pixel_values.dtype != self.lm.dtype:
            visual = replace(visual, pixel_values=visual.pixel_values.to(self.lm.dtype))
        session = VisualSession.create(self.lm, visual, headroom=self.headroom)
        entry = _Entry(
            session=session,
            ingested=replace(ingested, visual=_drop_pixels(ingested.visual)),
            kv_bytes=session.kv_bytes(),
            uses=1,
        )
        self._sessions[key] = entry
        self.sessions_built += 1
        self._evict(keep=key)
        return entry, True

    def _evict(self, keep: str) -> None:
        """Drop least recently used sessions (never `keep`) until the cached KV fits the budget."""
        for e in self._sessions.values():
            e.kv_bytes = e.session.kv_bytes()  # buffers grow when a long answer outgrows the headroom
        while self.cached_bytes > self.cache_bytes:
            victim = next((k for k in self._sessions if k != keep), None)
            if victim is None:
                break
            del self._sessions[victim]
            self.evictions += 1

    @property
    def cached_bytes(self) -> int:
        return sum(e.kv_bytes for e in self._sessions.values())

    def cached_keys(self) -> list[str]:
        return list(self._sessions)

    # -- tasks ------------------------------------------------------------------------------------
    def answer(
        self,
        job_id: str,
        source: VideoSource,
        task: TaskInput,
        decoding: DecodeInput,
        remaining_s: float | None = None,
        attempt: int = 1,
    ) -> TaskResult:
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        self._check(job_id, attempt, deadline)
        entry, built = self._session(source, None)
        session = entry.session
        proposer = make_proposer(decoding.method, session, self.std)
        method = resolve_method(decoding.method, session)
        cfg = decoding.config()
        prompt = task.prompt
        if (self.qa_turns and task.type == "qa") or (self.caption_turns and task.type == "caption"):
            if entry.object_list is None:
                entry.object_list = self._object_list(job_id, attempt, deadline, session, decoding)
            prompt = after_list(entry.object_list, task.prompt)
        prompt_ids = self.lm.suffix_ids(prompt)
        stats = SpecDecodeStats()
        tokens: list[int] = []
        first_token_at = 0.0
        gen = generate(session, prompt_ids, cfg, proposer, stats)
        try:
            for chunk in gen:
                if not tokens:
                    first_token_at = time.time()
                tokens += chunk
                self._check(job_id, attempt, deadline)
        finally:
            gen.close()  # the engine truncates the session back to its visual prefix
        self.tasks_answered += 1
        self._evict(keep=source.key)
        session_built = None
        if built:
            session_built = {
                "frames": entry.ingested.frames,
                "visual_tokens": session.num_visual_tokens,
                "ingest_s": entry.ingested.ingest_s,
                "encode_s": session.encode_s,
                "prefill_s": session.prefill_s,
            }
        return TaskResult(
            type=task.type,
            question=task.prompt,
            text=self.lm.decode(tokens),
            tokens=tokens,
            num_tokens=len(tokens),
            method=method,
            requested_method=decoding.method,
            stats=stats.to_dict(),
            ttft_s=stats.ttft_s,
            decode_s=stats.decode_s,
            tokens_per_target_forward=len(tokens) / (stats.num_steps + 1),
            first_token_at=first_token_at,
            session_cache="miss" if built else "hit",
            worker_state=self.state().to_dict(),
            session_built=session_built,
        )

    def _object_list(
        self, job_id: str, attempt: int, deadline: float | None, session: VisualSession, decoding: DecodeInput
    ) -> str:
        """The first turn of two-turn QA: the model's greedy reply to ``LIST_PROMPT`` (any lossless method gives
        the same), decoded with the task's method; cancel and deadline apply as to the answer."""
        cfg = replace(decoding, temperature=0.0, max_new_tokens=LIST_MAX_TOKENS, ignore_eos=False).config()
        proposer = make_proposer(decoding.method, session, self.std)
        tokens: list[int] = []
        gen = generate(session, self.lm.suffix_ids(LIST_PROMPT), cfg, proposer, SpecDecodeStats())
        try:
            for chunk in gen:
                tokens += chunk
                self._check(job_id, attempt, deadline)
        finally:
            gen.close()
        return " ".join(self.lm.decode(tokens).split())

    def _check(self, job_id: str, attempt: int, deadline: float | None) -> None:
        if (job_id, attempt) in self._cancels:
            raise JobCancelled(f"job {job_id} (attempt {attempt}) was cancelled")
        if deadline is not None and time.monotonic() > deadline:
            raise JobTimedOut(f"job {job_id} ran out of time while decoding")

    def cancel(self, job_id: str, attempt: int = 1) -> None:
        """Stop the task of this job attempt that is running or will run here (thread-safe)."""
        self._cancels.add((job_id, attempt))

    def state(self) -> WorkerState:
        """A fresh snapshot; each call takes the next `seq` (call it from the model-work thread)."""
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        return WorkerState(
            incarnation=self.incarnation,
            seq=seq,
            evictions=self.evictions,
            cached_videos=len(self._sessions),
            cached_bytes=self.cached_bytes,
        )

    def stats(self) -> WorkerStats:
        return WorkerStats(
            model=self.lm.name,
            sessions_built=self.sessions_built,
            session_hits=self.session_hits,
            evictions=self.evictions,
            tasks_answered=self.tasks_answered,
            cached_videos=list(self._sessions),
            cached_bytes=self.cached_bytes,
            budget_bytes=self.cache_bytes,
        )


def _drop_pixels(visual: Any) -> Any:
    """The cached entry keeps the video's metadata, not its pixels (the KV is what is reused)."""
    return replace(visual, pixel_values=visual.pixel_values.new_empty(0))


@ray.remote(concurrency_groups={"control": 1})
class VideoWorker:
    """Ray shell over `VideoWorkerCore`. Create with `.options(max_restarts=..., num_cpus=, num_gpus=)`;
    a restart reruns `__init__` (reloads the model, empty session cache)."""

    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        cache_bytes: int = 4 * 1024**3,
        torch_threads: int = 1,
        ingest_actor: str | None = None,
        core_cls: type[VideoWorkerCore] | None = None,
    ) -> None:
        # `ingest_actor` is the *name* of an IngestActor: a handle among the constructor arguments would
        # have to live in the object store for restarts (Ray warns), a name is looked up when needed.
        torch.set_num_threads(torch_threads)
        fallback: IngestFn | None = None
        if ingest_actor is not None:
            name = ingest_actor

            def fallback(source: VideoSource) -> IngestedVideo:
                return ray.get(ray.get_actor(name).ingest.remote(source))

        self.core = (core_cls or VideoWorkerCore)(
            model_dir, device=device, cache_bytes=cache_bytes, ingest=fallback
        )

    def open_video(self, source: VideoSource, ingested: IngestedVideo | None = None) -> SessionInfo:
        return self.core.open_video(source, ingested)

    def answer(
        self,
        job_id: str,
        source: VideoSource,
        task: TaskInput,
        decoding: DecodeInput,
        remaining_s: float | None = None,
        attempt: int = 1,
    ) -> TaskResult:
        return self.core.answer(job_id, source, task, decoding, remaining_s, attempt)

    def stats(self) -> WorkerStats:
        return self.core.stats()

    def state(self) -> WorkerState:
        return self.core.state()

    def cached_keys(self) -> list[str]:
        return self.core.cached_keys()

    @ray.method(concurrency_group="control")
    def cancel(self, job_id: str, attempt: int = 1) -> None:
        self.core.cancel(job_id, attempt)

    @ray.method(concurrency_group="control", max_task_retries=-1)  # waits out a restart (see dispatcher)
    def ping(self) -> bool:
        return True
