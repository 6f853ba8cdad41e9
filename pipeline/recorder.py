"""What the dispatcher sees, turned into the serving process's metrics; and the readiness probe.

Contract:
- `MetricsRecorder(metrics, model_name)` records into one `monitoring.metrics.ServiceMetrics` (one per
  serving process). Actors never touch Prometheus: they return their numbers as plain data with every
  result (see monitoring/metrics.py for why), and the dispatcher hands that data here. Every call comes from
  the dispatcher's thread; the HTTP thread only reads the registry (prometheus_client locks its values).
  No job id ever becomes a label: labels are `model_name` (the model directory's name), `method`, `status`.
- `task(result)`: every finished task, whatever becomes of its job afterwards (the work was done), under the
  concrete method: "std", "sparrow", "vanilla", "lvspec:std" (an `auto:` prefix is dropped). A task that
  had to rebuild an evicted session also counts as a session miss with that rebuild's video numbers.
- `session(info)`: the job's video opened on a worker. A miss (ingest + vision tower + prefill happened)
  records the video (frames, visual tokens, ingest seconds, visual prefill = vision tower + prefix prefill)
  and a session miss; a hit counts one session hit (the job skipped all of that).
- `worker_state(worker, state)`: a worker's `WorkerState` dict as it came with a result. Evictions are
  counted from the workers' cumulative counters, per incarnation (a restarted actor counts from zero
  again; a report older than one already seen moves nothing). The `kv_cache_bytes` and `cached_sessions`
  gauges are the sums over the workers of their newest reports; `worker_down(worker)` zeroes a crashed
  worker's share (its restart starts empty).
- `job(status, submitted_at, started_at, finished_at)`: a job outcome this process wrote: jobs by status,
  queue time (submit -> start of the attempt that finished) and end-to-end latency (submit -> finish).
- `dead_letter(finished_job)`, `worker_restart()`, `queue_depth(n)`, `jobs_running(n)`: as named.
- `Readiness()` is the `/readyz` check of `vidspec serve`: `{"redis": bool, "workers": n}` where `redis`
  says Redis answered PING and `n` counts the video-worker actors that answered a ping, each within
  `timeout_s`; both must be truthy for the service to be ready. Before `attach` and after `detach` (startup,
  shutdown) it reports not ready.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
import redis
from ray.exceptions import GetTimeoutError, RayError

from monitoring.metrics import ServiceMetrics
from workers.video_worker import SessionInfo, TaskResult

log = logging.getLogger("vidspec.metrics")


def concrete_method(name: str) -> str:
    """The metric label of a method: what actually decoded, without `auto:` ("auto:std" -> "std")."""
    return ":".join(part for part in name.split(":") if part != "auto") or "vanilla"


@dataclass
class _Worker:
    """The newest report of one video worker (by incarnation and sequence number)."""

    incarnation: str = ""
    seq: int = -1
    evictions: int = 0
    cached_videos: int = 0
    cached_bytes: int = 0
    retired: set[str] = field(default_factory=set)  # incarnations that restarted since


class MetricsRecorder:
    def __init__(self, metrics: ServiceMetrics, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self._workers: dict[int, _Worker] = {}
        m = metrics
        # this model's cache series exist from the start: the panels show 0, not "no data"
        for child in (
            m.kv_cache_bytes,
            m.cached_sessions,
            m.session_hits,
            m.session_misses,
            m.session_evictions,
        ):
            child.labels(model_name=model_name)

    # -- results ----------------------------------------------------------------------------------
    def task(self, result: TaskResult) -> None:
        stats = dict(result.stats)
        stats["method"] = concrete_method(str(stats.get("method") or result.method))
        self.metrics.observe_task(self.model_name, stats)
        if result.session_built is not None:
            b = result.session_built
            self._video(
                int(b["frames"]), int(b["visual_tokens"]), b["ingest_s"], b["encode_s"] + b["prefill_s"]
            )

    def session(self, info: SessionInfo) -> None:
        if info.cache == "miss":
            self._video(info.frames, info.visual_tokens, info.ingest_s, info.encode_s + info.prefill_s)
        else:
            self.metrics.session_hits.labels(model_name=self.model_name).inc()

    def _video(self, frames: int, visual_tokens: int, ingest_s: float, prefill_s: float) -> None:
        self.metrics.observe_video(self.model_name, frames, visual_tokens, ingest_s, prefill_s)

    # -- worker state -----------------------------------------------------------------------------
    def worker_state(self, worker: int, state: dict[str, Any]) -> None:
        """Fold in a `WorkerState.to_dict()` reported by video worker `worker` (see the module docstring)."""
        if not state:
            return
        w = self._workers.setdefault(worker, _Worker())
        incarnation, seq, evictions = str(state["incarnation"]), int(state["seq"]), int(state["evictions"])
        if incarnation != w.incarnation:
            if incarnation in w.retired:
                return  # a late report of an actor that has restarted since
            if w.incarnation:
                w.retired.add(w.incarnation)
            w.incarnation, w.seq, w.evictions = incarnation, -1, 0
        if evictions > w.evictions:
            self.metrics.session_evictions.labels(model_name=self.model_name).inc(evictions - w.evictions)
            w.evictions = evictions
        if seq > w.seq:
            w.seq = seq
            w.cached_videos, w.cached_bytes = int(state["cached_videos"]), int(state["cached_bytes"])
            self._set_cache_gauges()

    def worker_down(self, worker: int) -> None:
        """Video worker `worker` crashed: Ray restarts it with an empty session cache."""
        w = self._workers.get(worker)
        if w is not None:
            w.cached_videos = w.cached_bytes = 0
            self._set_cache_gauges()

    def _set_cache_gauges(self) -> None:
        workers = self._workers.values()
        self.metrics.kv_cache_bytes.labels(model_name=self.model_name).set(
            sum(w.cached_bytes for w in workers)
        )
        self.metrics.cached_sessions.labels(model_name=self.model_name).set(
            sum(w.cached_videos for w in workers)
        )

    # -- jobs and the queue -----------------------------------------------------------------------
    def job(
        self, status: str, submitted_at: float | None, started_at: float | None, finished_at: float
    ) -> None:
        """A job outcome this process wrote; times are Unix seconds (None or 0: unknown)."""
        queue_s = started_at - submitted_at if submitted_at and started_at else None
        e2e_s = finished_at - submitted_at if submitted_at else None
        self.metrics.observe_job(
            self.model_name,
            status,
            None if queue_s is None else max(0.0, queue_s),
            None if e2e_s is None else max(0.0, e2e_s),
        )

    def dead_letter(self) -> None:
        self.metrics.dead_lettered.inc()

    def worker_restart(self) -> None:
        self.metrics.worker_restarts.inc()

    def queue_depth(self, waiting: int) -> None:
        self.metrics.queue_depth.set(waiting)

    def jobs_running(self, n: int) -> None:
        self.metrics.jobs_running.set(n)


class Readiness:
    """The readiness check of a serving process (see the module docstring); callable from any thread."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._redis: redis.Redis | None = None
        self._workers: list[Any] = []

    def attach(self, redis_url: str, workers: list[Any]) -> None:
        """Start checking this Redis and these video-worker actor handles."""
        client = redis.Redis.from_url(
            redis_url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s
        )
        with self._lock:
            old, self._redis, self._workers = self._redis, client, list(workers)
        if old is not None:
            old.close()

    def detach(self) -> None:
        """Report not ready from now on (the service is stopping)."""
        with self._lock:
            old, self._redis, self._workers = self._redis, None, []
        if old is not None:
            old.close()

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            client, workers = self._redis, list(self._workers)
        return {"redis": self._redis_ok(client), "workers": self._workers_ok(workers)}

    def _redis_ok(self, client: redis.Redis | None) -> bool:
        if client is None:
            return False
        try:
            return bool(client.ping())
        except redis.RedisError as exc:
            log.warning("readiness: Redis does not answer PING: %s", exc)
            return False

    def _workers_ok(self, workers: list[Any]) -> int:
        if not workers:
            return 0
        refs = [w.ping.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        answered = 0
        for ref in ready:
            try:
                answered += bool(ray.get(ref, timeout=0))
            except (RayError, GetTimeoutError) as exc:
                log.warning("readiness: a video worker's ping failed: %s", exc)
        return answered
