"""Service settings: frozen dataclasses, validated at construction, built from the environment at the edge.

Contract:
- `Settings.from_env(env)` reads only `VIDSPEC_*` variables (table below); anything unset takes the
  dataclass default. A malformed value raises `ConfigError` naming the variable and what it accepts.
- `VIDSPEC_REDIS_URL` unset means "start an embedded redis-server" (infra/redis_server.py);
  `VIDSPEC_RAY_ADDRESS` unset means "start a local Ray" (infra/ray_runtime.py). Both accept real
  deployments: `redis://:password@host:6379/0`, `rediss://...` (TLS); `ray://head:10001` or `auto`.
- Nothing here opens a connection or imports Redis/Ray.

| variable | field | default |
|---|---|---|
| VIDSPEC_REDIS_URL | redis_url | embedded server |
| VIDSPEC_RAY_ADDRESS | ray_address | local Ray |
| VIDSPEC_RUNTIME_DIR | runtime_dir | runtime |
| VIDSPEC_MODEL | model_dir | models/vidspec-reference (else a tiny random model) |
| VIDSPEC_INPUT_ROOTS | input.roots (os.pathsep-separated) | the current directory |
| VIDSPEC_ALLOW_HTTP | input.allow_http (1/0) | 0 |
| VIDSPEC_MAX_VIDEO_BYTES | input.max_bytes | 2 GiB |
| VIDSPEC_MAX_VIDEO_DURATION_S | input.max_duration_s | 14400 |
| VIDSPEC_MAX_VIDEO_WIDTH / _HEIGHT | input.max_width / max_height | 3840 / 2160 |
| VIDSPEC_MAX_FRAMES | input.max_frames | 4096 |
| VIDSPEC_INGEST_MEMORY_BYTES | input.max_sample_bytes | 2 GiB |
| VIDSPEC_HTTP_TIMEOUT_S | input.http_timeout_s | 30 |
| VIDSPEC_CLAIM_IDLE_S | queue.claim_idle_s | 60 |
| VIDSPEC_HEARTBEAT_S | queue.heartbeat_s | 10 |
| VIDSPEC_RECLAIM_EVERY_S | queue.reclaim_every_s | 5 |
| VIDSPEC_MAX_DELIVERIES | queue.max_deliveries | 3 |
| VIDSPEC_JOB_TIMEOUT_S | queue.job_timeout_s | 1800 |
| VIDSPEC_RESULT_TTL_S | queue.result_ttl_s | 604800 (7 days) |
| VIDSPEC_VIDEO_WORKERS | workers.video_workers | 1 |
| VIDSPEC_INGEST_WORKERS | workers.ingest_workers | 1 |
| VIDSPEC_MAX_IN_FLIGHT | workers.max_in_flight | 4 |
| VIDSPEC_SESSION_CACHE_BYTES | workers.session_cache_bytes | 4 GiB |
| VIDSPEC_DEVICE | workers.device | auto |
| VIDSPEC_TORCH_THREADS | workers.torch_threads | 1 |
| VIDSPEC_WORKER_GPUS | workers.worker_gpus | 0 |
| VIDSPEC_RAY_NUM_CPUS | ray_num_cpus (local Ray only) | 2 |
| VIDSPEC_RAY_OBJECT_STORE_BYTES | ray_object_store_bytes (local Ray only) | 200 MiB |
| VIDSPEC_METRICS_HOST | metrics_host (`vidspec serve`'s /metrics, /healthz, /readyz) | 0.0.0.0 |
| VIDSPEC_METRICS_PORT | metrics_port (0: a free port, printed at start) | 9464 |
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from infra import keys

GIB = 1024**3
MIB = 1024**2


class ConfigError(ValueError):
    """A setting (usually an environment variable) has a value the service cannot use."""


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class InputPolicy:
    """Which video URIs the ingest stage accepts, and how large a video may be."""

    roots: tuple[Path, ...] = field(default_factory=lambda: (Path.cwd(),))
    allow_http: bool = False
    max_bytes: int = 2 * GIB
    max_duration_s: float = 4 * 3600.0
    max_width: int = 3840
    max_height: int = 2160
    max_frames: int = 4096  # cap on sampled frames per video, whatever the request asks
    max_sample_bytes: int = 2 * GIB  # sampled frames held at once: frames x width x height x 3
    http_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.roots:
            raise ConfigError("InputPolicy.roots: at least one directory is needed (VIDSPEC_INPUT_ROOTS)")
        object.__setattr__(self, "roots", tuple(Path(r).expanduser().resolve() for r in self.roots))
        for name in ("max_bytes", "max_width", "max_height", "max_frames", "max_sample_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"InputPolicy.{name} must be an int >= 1, got {value!r}")
        _positive("InputPolicy.max_duration_s", self.max_duration_s)
        _positive("InputPolicy.http_timeout_s", self.http_timeout_s)


@dataclass(frozen=True)
class QueueSettings:
    """Delivery, recovery and retention of jobs (see infra/queue.py for the semantics)."""

    claim_idle_s: float = 60.0  # a pending entry not heartbeaten for this long belongs to a dead consumer
    heartbeat_s: float = 10.0  # running jobs refresh their entry's idle time this often
    reclaim_every_s: float = 5.0  # how often a dispatcher sweeps for entries of dead consumers
    max_deliveries: int = 3  # a job delivered more often than this goes to the dead-letter stream
    job_timeout_s: float = 1800.0  # default per-job limit on running time (a request may ask for less)
    result_ttl_s: int = keys.DEFAULT_RESULT_TTL_S
    block_s: float = 1.0  # longest blocking read on an idle dispatcher
    poll_s: float = 0.02  # wait per loop while jobs are in flight

    def __post_init__(self) -> None:
        for name in ("claim_idle_s", "heartbeat_s", "reclaim_every_s", "job_timeout_s", "block_s", "poll_s"):
            _positive(f"QueueSettings.{name}", getattr(self, name))
        if self.heartbeat_s * 2 > self.claim_idle_s:
            raise ConfigError(
                f"QueueSettings.heartbeat_s ({self.heartbeat_s}) must be at most half of claim_idle_s "
                f"({self.claim_idle_s}), or live jobs would be reclaimed from their own dispatcher"
            )
        for name in ("max_deliveries", "result_ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"QueueSettings.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class WorkerSettings:
    """How many actors of each kind, what they may hold, and where they run."""

    video_workers: int = 1
    ingest_workers: int = 1
    max_in_flight: int = 4  # jobs a dispatcher runs at once (the rest wait in the stream)
    session_cache_bytes: int = 4 * GIB  # KV of cached visual sessions per video worker (LRU beyond)
    device: str = "auto"
    torch_threads: int = 1
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    ingest_cpus: float = 0.5
    max_restarts: int = -1  # -1: a crashed worker actor is always restarted

    def __post_init__(self) -> None:
        for name in (
            "video_workers",
            "ingest_workers",
            "max_in_flight",
            "session_cache_bytes",
            "torch_threads",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"WorkerSettings.{name} must be an int >= 1, got {value!r}")
        for name in ("worker_cpus", "worker_gpus", "ingest_cpus"):
            _positive(f"WorkerSettings.{name}", getattr(self, name), allow_zero=True)
        if self.max_restarts < -1:
            raise ConfigError(f"WorkerSettings.max_restarts must be >= -1, got {self.max_restarts}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"WorkerSettings.device must be auto, cpu or cuda[:N], got {self.device!r}")


@dataclass(frozen=True)
class Settings:
    redis_url: str | None = None
    ray_address: str | None = None
    runtime_dir: Path = Path("runtime")
    model_dir: Path | None = None
    queue: QueueSettings = field(default_factory=QueueSettings)
    input: InputPolicy = field(default_factory=InputPolicy)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    ray_num_cpus: int = 2
    ray_object_store_bytes: int = 200 * MIB
    metrics_host: str = "0.0.0.0"  # Prometheus scrapes from elsewhere; 127.0.0.1 keeps it local
    metrics_port: int = 9464  # 0: pick a free port

    def __post_init__(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"VIDSPEC_REDIS_URL must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        object.__setattr__(self, "runtime_dir", Path(self.runtime_dir).expanduser().resolve())
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", Path(self.model_dir).expanduser())
        if self.ray_num_cpus < 1:
            raise ConfigError(f"Settings.ray_num_cpus must be >= 1, got {self.ray_num_cpus}")
        if self.ray_object_store_bytes < 78 * MIB:  # Ray refuses smaller object stores
            raise ConfigError(
                f"Settings.ray_object_store_bytes must be >= 78 MiB, got {self.ray_object_store_bytes}"
            )
        port = self.metrics_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(
                f"VIDSPEC_METRICS_PORT must be an int in 0..65535 (0: a free port), got {port!r}"
            )
        if not self.metrics_host:
            raise ConfigError("VIDSPEC_METRICS_HOST must name an address to listen on (e.g. 0.0.0.0)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        r = _EnvReader(env)
        roots = r.text("VIDSPEC_INPUT_ROOTS")
        policy = InputPolicy(
            roots=tuple(Path(p) for p in roots.split(os.pathsep) if p) if roots else (Path.cwd(),),
            allow_http=r.flag("VIDSPEC_ALLOW_HTTP", InputPolicy.allow_http),
            max_bytes=r.integer("VIDSPEC_MAX_VIDEO_BYTES", InputPolicy.max_bytes),
            max_duration_s=r.number("VIDSPEC_MAX_VIDEO_DURATION_S", InputPolicy.max_duration_s),
            max_width=r.integer("VIDSPEC_MAX_VIDEO_WIDTH", InputPolicy.max_width),
            max_height=r.integer("VIDSPEC_MAX_VIDEO_HEIGHT", InputPolicy.max_height),
            max_frames=r.integer("VIDSPEC_MAX_FRAMES", InputPolicy.max_frames),
            max_sample_bytes=r.integer("VIDSPEC_INGEST_MEMORY_BYTES", InputPolicy.max_sample_bytes),
            http_timeout_s=r.number("VIDSPEC_HTTP_TIMEOUT_S", InputPolicy.http_timeout_s),
        )
        queue = QueueSettings(
            claim_idle_s=r.number("VIDSPEC_CLAIM_IDLE_S", QueueSettings.claim_idle_s),
            heartbeat_s=r.number("VIDSPEC_HEARTBEAT_S", QueueSettings.heartbeat_s),
            reclaim_every_s=r.number("VIDSPEC_RECLAIM_EVERY_S", QueueSettings.reclaim_every_s),
            max_deliveries=r.integer("VIDSPEC_MAX_DELIVERIES", QueueSettings.max_deliveries),
            job_timeout_s=r.number("VIDSPEC_JOB_TIMEOUT_S", QueueSettings.job_timeout_s),
            result_ttl_s=r.integer("VIDSPEC_RESULT_TTL_S", QueueSettings.result_ttl_s),
        )
        workers = WorkerSettings(
            video_workers=r.integer("VIDSPEC_VIDEO_WORKERS", WorkerSettings.video_workers),
            ingest_workers=r.integer("VIDSPEC_INGEST_WORKERS", WorkerSettings.ingest_workers),
            max_in_flight=r.integer("VIDSPEC_MAX_IN_FLIGHT", WorkerSettings.max_in_flight),
            session_cache_bytes=r.integer("VIDSPEC_SESSION_CACHE_BYTES", WorkerSettings.session_cache_bytes),
            device=r.text("VIDSPEC_DEVICE") or WorkerSettings.device,
            torch_threads=r.integer("VIDSPEC_TORCH_THREADS", WorkerSettings.torch_threads),
            worker_gpus=r.number("VIDSPEC_WORKER_GPUS", WorkerSettings.worker_gpus),
        )
        model = r.text("VIDSPEC_MODEL")
        return cls(
            redis_url=r.text("VIDSPEC_REDIS_URL") or None,
            ray_address=r.text("VIDSPEC_RAY_ADDRESS") or None,
            runtime_dir=Path(r.text("VIDSPEC_RUNTIME_DIR") or "runtime"),
            model_dir=Path(model) if model else None,
            queue=queue,
            input=policy,
            workers=workers,
            ray_num_cpus=r.integer("VIDSPEC_RAY_NUM_CPUS", cls.ray_num_cpus),
            ray_object_store_bytes=r.integer("VIDSPEC_RAY_OBJECT_STORE_BYTES", cls.ray_object_store_bytes),
            metrics_host=r.text("VIDSPEC_METRICS_HOST") or cls.metrics_host,
            metrics_port=r.integer("VIDSPEC_METRICS_PORT", cls.metrics_port),
        )


@dataclass(frozen=True)
class _EnvReader:
    env: Mapping[str, str]

    def text(self, name: str) -> str:
        return self.env.get(name, "").strip()

    def integer(self, name: str, default: int) -> int:
        raw = self.text(name)
        if not raw:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None

    def number(self, name: str, default: float) -> float:
        raw = self.text(name)
        if not raw:
            return default
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {raw!r}") from None

    def flag(self, name: str, default: bool) -> bool:
        raw = self.text(name).lower()
        if not raw:
            return default
        if raw in ("1", "true", "yes", "on"):
            return True
        if raw in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be 1/0 (or true/false, yes/no, on/off), got {raw!r}")
