"""Prometheus metrics of the service, and the HTTP endpoint that serves them with health checks.

Contract (DESIGN.md, prefix `vidspec_`, base units, counters end in `_total`, labels `model_name` and
`method` where they apply, never a job id):
  vidspec_spec_decode_num_drafts_total, vidspec_spec_decode_num_draft_tokens_total,
  vidspec_spec_decode_num_accepted_tokens_total, vidspec_spec_decode_num_accepted_tokens_per_pos_total
  (+ `position`); histograms vidspec_time_to_first_token_seconds, vidspec_inter_token_latency_seconds,
  vidspec_e2e_job_latency_seconds, vidspec_queue_time_seconds, vidspec_visual_prefill_seconds; gauges
  vidspec_queue_depth, vidspec_jobs_running, vidspec_kv_cache_bytes; counters vidspec_jobs_total
  (+ `status`), vidspec_frames_decoded_total, vidspec_visual_tokens_total.
Also: generated tokens, per-task decode time, cached-session hits/misses/evictions and count, worker
restarts, dead-lettered jobs.

How metrics produced inside Ray actors reach the one `/metrics` endpoint: they don't need to. Actors return
their numbers as plain data with every result (`SpecDecodeStats.to_dict()`, ingest and prefill times,
cache hit/miss/evictions), and the dispatcher, which writes results to Redis anyway, records them here in
the serving process. One registry, no per-actor exporters to discover or scrape, nothing lost when an actor
restarts (its counters would reset), and it works the same across nodes. Stats stay data in `decoders/`.

Key rates (PromQL), as vLLM's dashboards define them:
  acceptance rate:      rate(vidspec_spec_decode_num_accepted_tokens_total[5m])
                          / rate(vidspec_spec_decode_num_draft_tokens_total[5m])
  mean accepted length: 1 + rate(vidspec_spec_decode_num_accepted_tokens_total[5m])
                          / rate(vidspec_spec_decode_num_drafts_total[5m])
  acceptance by position: rate(vidspec_spec_decode_num_accepted_tokens_per_pos_total[5m])
                          / ignoring(position) group_left rate(vidspec_spec_decode_num_drafts_total[5m])
  decode tokens/s:      rate(vidspec_generation_tokens_total[1m])
  TTFT p95:             histogram_quantile(0.95, sum by (le) (rate(vidspec_time_to_first_token_seconds_bucket[5m])))
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# LLM-serving scale buckets (seconds), after vLLM's
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
JOB_BUCKETS = (
    0.1,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

TASK_LABELS = ("model_name", "method")


class ServiceMetrics:
    """All metric objects of one serving process, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.num_drafts = Counter(
            "vidspec_spec_decode_num_drafts_total",
            "Verification cycles that carried draft tokens",
            TASK_LABELS,
            registry=r,
        )
        self.num_draft_tokens = Counter(
            "vidspec_spec_decode_num_draft_tokens_total", "Draft tokens proposed", TASK_LABELS, registry=r
        )
        self.num_accepted = Counter(
            "vidspec_spec_decode_num_accepted_tokens_total", "Draft tokens accepted", TASK_LABELS, registry=r
        )
        self.accepted_per_pos = Counter(
            "vidspec_spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by position in the draft",
            (*TASK_LABELS, "position"),
            registry=r,
        )
        self.generation_tokens = Counter(
            "vidspec_generation_tokens_total", "Tokens generated", TASK_LABELS, registry=r
        )
        self.prompt_tokens = Counter(
            "vidspec_prompt_tokens_total",
            "Prompt-suffix tokens prefilled (visual prefix excluded)",
            TASK_LABELS,
            registry=r,
        )
        self.tasks = Counter("vidspec_tasks_total", "Tasks answered", (*TASK_LABELS, "lossy"), registry=r)
        self.ttft = Histogram(
            "vidspec_time_to_first_token_seconds", "Time to first token of a task", TASK_LABELS,
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "vidspec_inter_token_latency_seconds", "Mean time per token after the first, per generated token",
            TASK_LABELS, buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_time = Histogram(
            "vidspec_task_decode_seconds", "Decode time of a task (first token to last)", TASK_LABELS,
            buckets=JOB_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vidspec_e2e_job_latency_seconds", "Submit to finish of a job", ("model_name",),
            buckets=JOB_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "vidspec_queue_time_seconds",
            "Submit to start of a job",
            ("model_name",),
            buckets=JOB_BUCKETS,
            registry=r,
        )
        self.visual_prefill = Histogram(
            "vidspec_visual_prefill_seconds", "Vision tower + prefix prefill of one video", ("model_name",),
            buckets=PREFILL_BUCKETS, registry=r,
        )  # fmt: skip
        self.ingest_time = Histogram(
            "vidspec_ingest_seconds", "Decode + sampling + preprocessing of one video", ("model_name",),
            buckets=PREFILL_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("vidspec_queue_depth", "Jobs waiting in the stream", registry=r)
        self.jobs_running = Gauge("vidspec_jobs_running", "Jobs being processed", registry=r)
        self.kv_cache_bytes = Gauge(
            "vidspec_kv_cache_bytes", "Bytes held by cached visual sessions", ("model_name",), registry=r
        )
        self.cached_sessions = Gauge(
            "vidspec_cached_sessions", "Visual sessions held in memory", ("model_name",), registry=r
        )
        self.jobs = Counter("vidspec_jobs_total", "Finished jobs by outcome", ("status",), registry=r)
        self.frames = Counter(
            "vidspec_frames_decoded_total", "Video frames decoded and sampled", ("model_name",), registry=r
        )
        self.visual_tokens = Counter(
            "vidspec_visual_tokens_total", "Visual tokens prefilled", ("model_name",), registry=r
        )
        self.session_hits = Counter(
            "vidspec_session_cache_hits_total",
            "Jobs whose video's visual session was already cached (no ingest, no prefill)",
            ("model_name",),
            registry=r,
        )
        self.session_misses = Counter(
            "vidspec_session_cache_misses_total",
            "Videos that needed ingest + prefill (a job's first sight of it, or a rebuild after eviction)",
            ("model_name",),
            registry=r,
        )
        self.session_evictions = Counter(
            "vidspec_session_cache_evictions_total",
            "Cached sessions evicted (memory budget)",
            ("model_name",),
            registry=r,
        )
        self.worker_restarts = Counter("vidspec_worker_restarts_total", "Worker actors restarted", registry=r)
        self.dead_lettered = Counter(
            "vidspec_jobs_dead_lettered_total", "Jobs moved to the dead-letter stream", registry=r
        )

    # -- turning data into metrics ----------------------------------------------------------------
    def observe_task(self, model_name: str, stats: dict) -> None:
        """One answered task: `stats` is `SpecDecodeStats.to_dict()` (method = the concrete method used)."""
        method = str(stats.get("method", "vanilla"))
        labels = {"model_name": model_name, "method": method}
        self.num_drafts.labels(**labels).inc(stats.get("num_drafts", 0))
        self.num_draft_tokens.labels(**labels).inc(stats.get("num_draft_tokens", 0))
        self.num_accepted.labels(**labels).inc(stats.get("num_accepted_tokens", 0))
        for pos, count in enumerate(stats.get("accepted_per_pos") or []):
            self.accepted_per_pos.labels(**labels, position=str(pos)).inc(count)
        n = int(stats.get("new_tokens", 0))
        self.generation_tokens.labels(**labels).inc(n)
        self.prompt_tokens.labels(**labels).inc(stats.get("prompt_tokens", 0))
        lossy = bool((stats.get("extra") or {}).get("lossy", False))
        self.tasks.labels(**labels, lossy=str(lossy).lower()).inc()
        self.ttft.labels(**labels).observe(stats.get("ttft_s", 0.0))
        decode_s = float(stats.get("decode_s", 0.0))
        self.decode_time.labels(**labels).observe(decode_s)
        if n > 1:
            itl = decode_s / (n - 1)
            hist = self.itl.labels(**labels)
            for _ in range(n - 1):  # one observation per generated token, as vLLM counts it
                hist.observe(itl)

    def observe_video(
        self, model_name: str, frames: int, visual_tokens: int, ingest_s: float, prefill_s: float
    ) -> None:
        """A video ingested and prefilled (a session-cache miss)."""
        self.frames.labels(model_name=model_name).inc(frames)
        self.visual_tokens.labels(model_name=model_name).inc(visual_tokens)
        self.ingest_time.labels(model_name=model_name).observe(ingest_s)
        self.visual_prefill.labels(model_name=model_name).observe(prefill_s)
        self.session_misses.labels(model_name=model_name).inc()

    def observe_job(self, model_name: str, status: str, queue_s: float | None, e2e_s: float | None) -> None:
        self.jobs.labels(status=status).inc()
        if queue_s is not None:
            self.queue_time.labels(model_name=model_name).observe(queue_s)
        if e2e_s is not None:
            self.e2e.labels(model_name=model_name).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def exported_metric_names(metrics: ServiceMetrics) -> set[str]:
    """Every sample name the registry can expose (with _bucket/_sum/_count/_total/_created suffixes)."""
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
    return names


class MetricsServer:
    """`/metrics`, `/healthz` (alive) and `/readyz` (ready: Redis and at least one worker answer)."""

    def __init__(self, metrics: ServiceMetrics, host: str, port: int, ready: Callable[[], dict]) -> None:
        self.metrics, self.ready = metrics, ready
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    self._send(200, outer.metrics.render(), CONTENT_TYPE_LATEST)
                elif self.path.startswith("/healthz"):
                    self._send(200, b'{"status": "alive"}', "application/json")
                elif self.path.startswith("/readyz"):
                    checks = outer.ready()
                    ok = all(bool(v) for v in checks.values())
                    body = json.dumps({"ready": ok, "checks": checks}).encode()
                    self._send(200 if ok else 503, body, "application/json")
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: object) -> None:  # keep the service log clean
                return

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="vidspec-metrics", daemon=True)

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
