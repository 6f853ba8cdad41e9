"""The dispatcher: consumes the job stream, runs each job on the Ray actors, writes results and events.

Contract:
- One dispatcher is one consumer of group `vidspec-workers` (any number may run against one Redis). It
  takes at most `max_in_flight` jobs at a time (new ones with XREADGROUP, those of dead consumers with
  XAUTOCLAIM every `reclaim_every_s`), and bounds the work in flight with `ray.wait`: no `ray.get` on a
  pending result, ever.
- A job runs as a chain of actor calls, each started when the previous one is done: ingest (skipped when
  the chosen video worker already holds the video's session; shared by jobs of a video being ingested) ->
  open the session -> one call per task. Progress events (`ingested`, `session`, `task`) go to the job's
  events stream as the steps finish. The ingested pixels go from the ingest actor to the video worker by
  object ref; the dispatcher only fetches a small summary.
- Affinity: all jobs of one video (`VideoSource.key`) go to the worker that holds, or is building, its
  visual KV; a new video goes to the least loaded worker.
- Failures: a deterministic error of the job itself (bad request, input refused, unreadable video, unknown
  method) fails it at once with that message. A crashed actor or an unexpected error puts the job back
  (`JobQueue.retry`) for another delivery; the actor restarts by itself (`max_restarts`), and calls meant
  for it are parked until its ping answers (a restarting actor refuses calls). A job delivered more than
  `max_deliveries` times is dead-lettered by `JobQueue.start`.
- Cancel and timeout: every ~100 ms the dispatcher looks for `cancel_requested` and passed deadlines
  (`timeout_s` of the request, capped by `job_timeout_s`, counted from the start of the attempt); it ends the
  job (`cancelled`, or `failed` with "timed out") and tells the worker, which stops at its next token chunk.
- Results are written only by the attempt that owns the job (see infra/queue.py), so a job reclaimed from
  a slow dispatcher finishes exactly once. `close()` hands unfinished jobs back for immediate redelivery.
- Metrics: the dispatcher records into `metrics` (a `ServiceMetrics`; one per serving process, made here
  when none is given) through a `MetricsRecorder` (pipeline/recorder.py): every finished task, every
  session opened (hit or miss), the workers' reported cache state, every outcome it writes (jobs by
  status, queue time, e2e latency), dead letters, worker restarts; `jobs_running` every loop and the
  stream backlog (`queue_depth`: entries not yet delivered) every `METRICS_EVERY_S`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import redis
from ray.exceptions import RayActorError, RayError, RayTaskError

from infra.config import Settings
from infra.queue import Delivery, JobQueue, JobStatus
from monitoring.metrics import ServiceMetrics
from pipeline.recorder import MetricsRecorder
from pipeline.schema import JobRequest, RequestError, parse_request
from workers.ingest import IngestActor, IngestSummary
from workers.video_worker import (
    JobCancelled,
    JobTimedOut,
    SessionInfo,
    TaskResult,
    VideoWorker,
    VideoWorkerCore,
)

log = logging.getLogger("vidspec.dispatcher")

ActorId = tuple[str, int]  # ("video" | "ingest", index in the pool)

CONTROL_EVERY_S = 0.1  # cancel / timeout checks
PRUNE_EVERY_S = 600.0  # removal of long-silent consumers from the group
METRICS_EVERY_S = 1.0  # refresh of the queue-depth gauge (one XLEN + XPENDING round trip)
# fields of the workers' replies that are telemetry for the metrics, not part of a job's result
TELEMETRY_FIELDS = frozenset({"cached_keys", "worker_state", "session_built"})


class WorkerStartError(RuntimeError):
    """An actor of the pool could not start (its constructor failed); the message carries the cause."""


def _root_cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, through Ray's wrappers (nested calls wrap several times)."""
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


@dataclass
class WorkerPool:
    """The actors a dispatcher drives: video workers (model + session cache) and ingest actors."""

    video: list[Any]
    ingest: list[Any]
    model_dir: Path

    @classmethod
    def start(
        cls, settings: Settings, model_dir: Path, core_cls: type[VideoWorkerCore] = VideoWorkerCore
    ) -> WorkerPool:
        ws = settings.workers
        scratch = str(settings.runtime_dir / "ingest")
        tag = uuid.uuid4().hex[:8]  # several pools (dispatchers) may share one Ray cluster
        names = [f"vidspec-ingest-{tag}-{i}" for i in range(ws.ingest_workers)]
        ingest = [
            IngestActor.options(name=name, max_restarts=ws.max_restarts, num_cpus=ws.ingest_cpus).remote(
                str(model_dir), settings.input, scratch, ws.torch_threads
            )
            for name in names
        ]
        video = [
            VideoWorker.options(
                max_restarts=ws.max_restarts, num_cpus=ws.worker_cpus, num_gpus=ws.worker_gpus
            ).remote(
                str(model_dir),
                ws.device,
                ws.session_cache_bytes,
                ws.torch_threads,
                names[i % len(names)],
                None if core_cls is VideoWorkerCore else core_cls,
            )
            for i in range(ws.video_workers)
        ]
        pool = cls(video=video, ingest=ingest, model_dir=Path(model_dir))
        try:
            ray.get([a.ping.remote() for a in video + ingest])
        except RayActorError as exc:
            pool.shutdown()
            raise WorkerStartError(f"a worker actor failed to start with model {model_dir}: {exc}") from exc
        return pool

    def shutdown(self) -> None:
        for actor in self.video + self.ingest:
            ray.kill(actor, no_restart=True)
        self.video, self.ingest = [], []


@dataclass
class _Job:
    job_id: str
    entry_id: str
    attempt: int
    request: JobRequest
    worker: int
    submitted_at: float  # Unix times
    started_at: float
    deadline: float  # time.monotonic()
    limit_s: float
    step: str = "ingest"  # "ingest" | "open" | "task"
    shares_ingest: bool = False  # waits on the ingest another job of the same video started
    actor: ActorId = ("video", 0)  # the actor of the current step
    ref: Any = None
    task_index: int = 0
    ingested: IngestSummary | None = None
    visual_ref: Any = None  # the ingested pixels, passed to the video worker, never fetched here
    session: SessionInfo | None = None
    results: list[TaskResult] = field(default_factory=list)


@dataclass
class DispatcherStats:
    """Counters of one dispatcher (plain data; monitoring/ may export them)."""

    started: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    retried: int = 0
    skipped: int = 0
    dead_lettered: int = 0
    stale_results: int = 0


class Dispatcher:
    def __init__(
        self,
        queue: JobQueue,
        settings: Settings,
        pool: WorkerPool,
        consumer: str | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        if not pool.video or not pool.ingest:
            raise ValueError("the worker pool needs at least one video worker and one ingest actor")
        self.queue = queue
        self.settings = settings
        self.pool = pool
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stats = DispatcherStats()
        self.metrics = metrics if metrics is not None else ServiceMetrics()
        self.recorder = MetricsRecorder(self.metrics, pool.model_dir.name)
        self._jobs: dict[str, _Job] = {}
        self._by_ref: dict[Any, list[str]] = {}  # in-flight ref -> the jobs waiting on it
        # video key -> (worker, summary ref, pixels ref, ingest actor) of an ingest in flight
        self._ingesting: dict[str, tuple[int, Any, Any, ActorId]] = {}
        # An actor that crashed refuses calls until Ray has restarted it: calls meant for it wait here
        # until its ping (retried by Ray across the restart) answers.
        self._down: dict[Any, ActorId] = {}  # ping ref -> actor
        self._parked: dict[ActorId, list[tuple[str, str, Callable[[], Any]]]] = {}  # (job id, step, call)
        # keys each worker holds (as it last reported) or is building: bounded by the workers' caches
        self._cached: list[set[str]] = [set() for _ in pool.video]
        self._load = [0] * len(pool.video)
        self._next_ingest = 0
        now = time.monotonic()
        self._next_reclaim = now
        self._next_control = now
        self._next_heartbeat = now + settings.queue.heartbeat_s
        self._next_prune = now + PRUNE_EVERY_S
        self._next_metrics = now
        self._seeded = False

    # -- main loop --------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set, then hand unfinished jobs back (see `close`)."""
        backoff = 0.5
        try:
            while not stop.is_set():
                try:
                    self.step()
                    backoff = 0.5
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                    stop.wait(backoff)
                    backoff = min(10.0, backoff * 2)
        finally:
            self.close()

    def step(self) -> None:
        """One round: reclaim, read, advance finished steps, check cancels/timeouts, heartbeat."""
        if not self._seeded:
            self._seed()
        q = self.settings.queue
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + q.reclaim_every_s
            for d in self.queue.reclaim(self.consumer, self._free()):
                self._admit(d)
        if self._free() > 0:
            block = None if self._jobs else min(q.block_s, max(0.001, self._next_reclaim - time.monotonic()))
            for d in self.queue.read(self.consumer, self._free(), block_s=block):
                self._admit(d)
        if self._jobs:
            self._poll(q.poll_s)
        now = time.monotonic()
        if now >= self._next_control:
            self._next_control = now + CONTROL_EVERY_S
            self._control()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + q.heartbeat_s
            self._heartbeat()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            self.queue.prune_consumers(self.consumer, max(3600.0, 10 * q.claim_idle_s))
        self.recorder.jobs_running(len(self._jobs))
        if now >= self._next_metrics:
            self._next_metrics = now + METRICS_EVERY_S
            self.recorder.queue_depth(self.queue.depth().waiting)

    def close(self) -> None:
        """Hand every unfinished job back for immediate redelivery and stop the workers' work on it."""
        for job in list(self._jobs.values()):
            self._drop(job, cancel_on_worker=True)
            if self.queue.retry(job.job_id, job.attempt, self.consumer, "dispatcher shut down"):
                log.info("job %s handed back (dispatcher shutting down)", job.job_id)
        self.recorder.jobs_running(len(self._jobs))

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def _free(self) -> int:
        return self.settings.workers.max_in_flight - len(self._jobs)

    def _seed(self) -> None:
        """Learn what the workers already hold (a restarted dispatcher keeps using their KV)."""
        self.queue.ensure_group()
        n = len(self.pool.video)
        replies = ray.get(
            [w.cached_keys.remote() for w in self.pool.video] + [w.state.remote() for w in self.pool.video]
        )
        for i, keys in enumerate(replies[:n]):
            self._cached[i] = set(keys)
        for i, state in enumerate(replies[n:]):
            self.recorder.worker_state(i, state.to_dict())
        self._seeded = True

    def _route(self, key: str) -> int:
        """Affinity: the worker that holds or builds this video's KV; else the least loaded one."""
        for i, keys in enumerate(self._cached):
            if key in keys:
                return i
        return min(range(len(self.pool.video)), key=lambda i: (self._load[i], len(self._cached[i]), i))

    # -- admission --------------------------------------------------------------------------------
    def _admit(self, delivery: Delivery) -> None:
        start = self.queue.start(delivery, self.consumer)
        if start.finished:  # this step itself ended the job (dead-lettered, or a pending cancel)
            self.recorder.job(start.finished, start.submitted_at, None, time.time())
        if start.action == "skip":
            self.stats.skipped += 1
            log.info("entry %s (job %s) skipped: %s", delivery.entry_id, start.job_id, start.reason)
            return
        if start.action == "dead_letter":
            self.stats.dead_lettered += 1
            self.recorder.dead_letter()
            log.warning("job %s dead-lettered: %s", start.job_id, start.reason)
            return
        old = self._jobs.get(start.job_id)
        if old is not None:  # our own earlier attempt lost the job (e.g. a missed heartbeat)
            self._drop(old, cancel_on_worker=True)
        self.stats.started += 1
        try:
            request = parse_request(start.request)
        except RequestError as exc:
            self._finish(
                start.job_id, start.attempt, JobStatus.FAILED, error=f"invalid request: {exc}",
                submitted_at=start.submitted_at, started_at=start.started_at,
            )  # fmt: skip
            return
        limit = min(request.timeout_s or math.inf, self.settings.queue.job_timeout_s)
        key = request.video.key
        worker = self._route(key)
        job = _Job(
            job_id=start.job_id,
            entry_id=delivery.entry_id,
            attempt=start.attempt,
            request=request,
            worker=worker,
            submitted_at=start.submitted_at,
            started_at=start.started_at,
            deadline=time.monotonic() + limit,
            limit_s=limit,
        )
        self._jobs[job.job_id] = job
        self._load[worker] += 1
        pending = self._ingesting.get(key)
        w = self.pool.video[worker]
        if pending is not None and pending[0] == worker:  # the same video is being ingested: share it
            job.shares_ingest = True
            job.actor, job.visual_ref = pending[3], pending[2]
            self._call(job, "ingest", pending[1])
        elif key in self._cached[worker]:
            self._send(job, "open", ("video", worker), lambda: w.open_video.remote(request.video, None))
        else:
            self._cached[worker].add(key)  # being built there: later jobs of this video skip ingest
            i = self._next_ingest % len(self.pool.ingest)
            self._next_ingest += 1

            def start_ingest() -> Any:
                summary, job.visual_ref = self.pool.ingest[i].ingest_with_summary.remote(request.video)
                return summary

            self._send(job, "ingest", ("ingest", i), start_ingest)
            if job.ref is not None:
                self._ingesting[key] = (worker, job.ref, job.visual_ref, ("ingest", i))

    def _send(self, job: _Job, step: str, actor: ActorId, make_call: Callable[[], Any]) -> None:
        """Start the next step on `actor`, or park it until the actor is back from a restart."""
        job.actor = actor
        if actor in self._parked:
            job.step, job.ref = step, None
            self._parked[actor].append((job.job_id, step, make_call))
            return
        self._call(job, step, make_call())

    def _call(self, job: _Job, step: str, ref: Any) -> None:
        job.step, job.ref = step, ref
        self._by_ref.setdefault(ref, []).append(job.job_id)

    def _actor_down(self, actor: ActorId) -> None:
        if actor in self._parked:
            return
        self._parked[actor] = []
        kind, i = actor
        handle = self.pool.video[i] if kind == "video" else self.pool.ingest[i]
        self._down[handle.ping.remote()] = actor
        if kind == "video":
            self._forget_worker(i)
            self.recorder.worker_down(i)

    def _actor_up(self, ping: Any) -> None:
        actor = self._down.pop(ping)
        try:
            ray.get(ping, timeout=0)
        except RayError as exc:  # restarts exhausted, or killed: its jobs time out or are retried elsewhere
            log.error("%s actor %d is gone for good: %s", actor[0], actor[1], exc)
            return
        log.info("%s actor %d is back", *actor)
        self.recorder.worker_restart()
        for job_id, step, make_call in self._parked.pop(actor, []):
            job = self._jobs.get(job_id)
            if job is not None and job.ref is None and job.step == step:
                self._call(job, step, make_call())

    # -- progress ---------------------------------------------------------------------------------
    def _poll(self, timeout_s: float) -> None:
        refs = [*self._by_ref, *self._down]
        if not refs:
            time.sleep(timeout_s)
            return
        ready, rest = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            if ref in self._down:
                self._actor_up(ref)
                continue
            for key, (_, r, _, _) in list(self._ingesting.items()):
                if r == ref:
                    del self._ingesting[key]
            for job_id in self._by_ref.pop(ref, []):  # in admission order: the first builds, the rest hit
                job = self._jobs.get(job_id)
                if job is not None and job.ref == ref:
                    self._advance(job, ref)

    def _advance(self, job: _Job, ref: Any) -> None:
        try:
            value = ray.get(ref, timeout=0)
        except RayTaskError as exc:
            self._task_error(job, _root_cause(exc))
            return
        except RayError as exc:  # the actor or its node died, an object was lost: not the job's fault
            if isinstance(exc, RayActorError):
                self._actor_down(job.actor)
            self._retry(job, f"{job.step} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return
        worker = self.pool.video[job.worker]
        req = job.request
        if job.step == "ingest":
            ing: IngestSummary = value
            job.ingested = ing
            self.queue.event(
                job.job_id, "ingested", attempt=job.attempt, frames=ing.frames, duration_s=ing.duration_s,
                width=ing.width, height=ing.height, ingest_s=ing.ingest_s,
                shared=job.shares_ingest,
            )  # fmt: skip
            pixels = job.visual_ref
            self._send(
                job, "open", ("video", job.worker), lambda: worker.open_video.remote(req.video, pixels)
            )
            return
        if job.step == "open":
            info: SessionInfo = value
            job.session = info
            self.recorder.worker_state(job.worker, info.worker_state)
            self.recorder.session(info)
            job.visual_ref = None  # the worker holds the KV now; let the object store free the pixels
            building = {k for k, v in self._ingesting.items() if v[0] == job.worker}
            self._cached[job.worker] = set(info.cached_keys) | building  # the worker's LRU may have evicted
            self.queue.event(
                job.job_id, "session", attempt=job.attempt, cache=info.cache, visual_tokens=info.visual_tokens,
                ingest_s=info.ingest_s, encode_s=info.encode_s, prefill_s=info.prefill_s, kv_bytes=info.kv_bytes,
            )  # fmt: skip
        else:
            res: TaskResult = value
            job.results.append(res)
            self.recorder.worker_state(job.worker, res.worker_state)
            self.recorder.task(res)
            self.queue.event(
                job.job_id, "task", attempt=job.attempt, index=job.task_index, type=res.type,
                num_tokens=res.num_tokens, method=res.method, ttft_s=res.ttft_s, decode_s=res.decode_s,
                mean_accepted_length=res.stats.get("mean_accepted_length"),
                tokens_per_target_forward=res.tokens_per_target_forward,
            )  # fmt: skip
            job.task_index += 1
        if job.task_index >= len(req.tasks):
            self._succeed(job)
            return
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            self._timeout(job)
            return
        task = req.tasks[job.task_index]
        self._send(
            job,
            "task",
            ("video", job.worker),
            lambda: worker.answer.remote(
                job.job_id, req.video, task, req.decoding, job.deadline - time.monotonic(), job.attempt
            ),
        )

    def _task_error(self, job: _Job, cause: BaseException) -> None:
        if isinstance(cause, JobCancelled):
            self._finish_job(job, JobStatus.CANCELLED)
        elif isinstance(cause, JobTimedOut):
            self._timeout(job)
        elif isinstance(
            cause, ValueError
        ):  # the job's own fault: bad input, unreadable video, unknown method
            if job.step == "ingest":
                self._cached[job.worker].discard(job.request.video.key)
            self._finish_job(job, JobStatus.FAILED, error=f"{job.step}: {cause}")
        else:  # unexpected (a bug, out of memory...): maybe transient; the delivery limit bounds the retries
            self._retry(job, f"{job.step}: {type(cause).__name__}: {cause}")

    def _succeed(self, job: _Job) -> None:
        assert job.session is not None
        req = job.request
        first = job.results[0].first_token_at if job.results else 0.0
        video = {
            "uri": req.video.uri,
            "id": req.video.video_id,
            "fps": req.video.fps,
            "max_frames": req.video.max_frames,
        }
        video.update({k: v for k, v in job.session.to_dict().items() if k not in TELEMETRY_FIELDS})
        if job.ingested is not None:
            video.update(
                width=job.ingested.width, height=job.ingested.height, source_bytes=job.ingested.source_bytes
            )
        tasks = [
            {"index": i, **{k: v for k, v in r.to_dict().items() if k not in TELEMETRY_FIELDS}}
            for i, r in enumerate(job.results)
        ]
        result = {
            "job_id": job.job_id,
            "attempt": job.attempt,
            "model": self.pool.model_dir.name,
            "worker": job.worker,
            "video": video,
            "tasks": tasks,
            "timings": {
                "queue_s": job.started_at - job.submitted_at,
                "run_s": time.time() - job.started_at,
                "time_to_first_token_s": first - job.started_at if first else None,
                "submit_to_first_token_s": first - job.submitted_at if first else None,
            },
        }
        self._finish_job(job, JobStatus.SUCCEEDED, result=result)

    def _timeout(self, job: _Job) -> None:
        self._finish_job(
            job, JobStatus.FAILED, error=f"timed out after {time.monotonic() - (job.deadline - job.limit_s):.1f}s "
            f"(limit {job.limit_s:g}s, during {job.step})", cancel_on_worker=True,
        )  # fmt: skip

    # -- endings ----------------------------------------------------------------------------------
    def _drop(self, job: _Job, cancel_on_worker: bool = False) -> None:
        """Forget a job locally (its in-flight result, if any, will be ignored)."""
        if self._jobs.get(job.job_id) is job:
            del self._jobs[job.job_id]
            self._load[job.worker] -= 1
        waiting = self._by_ref.get(job.ref) if job.ref is not None else None
        if waiting is not None:
            if job.job_id in waiting:
                waiting.remove(job.job_id)
            if not waiting:
                del self._by_ref[job.ref]
                self._ingesting = {k: v for k, v in self._ingesting.items() if v[1] != job.ref}
        if cancel_on_worker and job.step != "ingest":
            self.pool.video[job.worker].cancel.remote(job.job_id, job.attempt)

    def _finish_job(
        self,
        job: _Job,
        status: JobStatus,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        cancel_on_worker: bool = False,
    ) -> None:
        self._drop(job, cancel_on_worker)
        self._finish(job.job_id, job.attempt, status, result, error, job.submitted_at, job.started_at)

    def _finish(
        self,
        job_id: str,
        attempt: int,
        status: JobStatus,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        submitted_at: float | None = None,
        started_at: float | None = None,
    ) -> None:
        """Write the outcome of `attempt` and record it (not when the attempt turned out stale)."""
        final = self.queue.finish(job_id, attempt, status, result=result, error=error)
        if final is None:
            self.stats.stale_results += 1
            log.warning(
                "job %s attempt %d: outcome %s discarded (the job moved on)", job_id, attempt, status.value
            )
            return
        self.stats.finished[final.value] += 1
        self.recorder.job(final.value, submitted_at, started_at, time.time())
        log.info("job %s %s%s", job_id, final.value, f": {error}" if error else "")

    def _retry(self, job: _Job, reason: str) -> None:
        self._drop(job)
        if self.queue.retry(job.job_id, job.attempt, self.consumer, reason):
            self.stats.retried += 1
            self._next_reclaim = time.monotonic()  # deliver it again right away
        log.warning("job %s attempt %d will be retried: %s", job.job_id, job.attempt, reason)

    def _forget_worker(self, worker: int) -> None:
        """A worker actor died: its restart has an empty session cache."""
        self._cached[worker].clear()

    # -- control ----------------------------------------------------------------------------------
    def _control(self) -> None:
        if not self._jobs:
            return
        for job_id in self.queue.cancel_requested(list(self._jobs)):
            job = self._jobs[job_id]
            self._finish_job(job, JobStatus.CANCELLED, cancel_on_worker=True)
        now = time.monotonic()
        for job in [j for j in self._jobs.values() if now > j.deadline]:
            self._timeout(job)

    def _heartbeat(self) -> None:
        if not self._jobs:
            return
        by_entry = {j.entry_id: j for j in self._jobs.values()}
        for entry in self.queue.heartbeat(self.consumer, list(by_entry)):
            job = by_entry[entry]
            log.warning(
                "job %s was taken over by another consumer; abandoning attempt %d", job.job_id, job.attempt
            )
            self._drop(job, cancel_on_worker=True)
