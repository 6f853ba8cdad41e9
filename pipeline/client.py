"""A small Python client for producers: submit jobs, follow them, fetch results, cancel.

Contract:
- `Client.connect(url)` talks to the Redis at `url`; with no URL it uses `VIDSPEC_REDIS_URL`, else the
  embedded Redis of a `vidspec serve` running on this machine (it writes `<runtime>/service.json`).
- `submit(request)` validates the request (`pipeline.schema`) and enqueues it; idempotent by job id.
- `status(job_id)` -> `JobInfo`; `result(job_id)` -> the result dict of a succeeded job, raising
  `JobNotFinished` while it is queued/running and `JobFailed` (with the error) when it failed or was
  cancelled; `cancel(job_id)` -> the status afterwards; `wait(job_id, timeout_s, on_event)` blocks on the
  job's events stream (no polling loop on the hash) until the job is finished, calling `on_event` for
  each progress event, and returns the final `JobInfo` (raising `TimeoutError` past `timeout_s`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.config import QueueSettings, Settings
from infra.queue import Event, JobInfo, JobQueue, JobStatus, QueueError, SubmitResult
from pipeline.schema import JobRequest, parse_request

SERVICE_FILE = "service.json"


class NoService(QueueError):
    """There is no Redis to talk to (no URL given and no local `vidspec serve`)."""


class JobNotFinished(QueueError):
    def __init__(self, info: JobInfo) -> None:
        super().__init__(f"job {info.job_id} is {info.status.value}; no result yet")
        self.info = info


class JobFailed(QueueError):
    def __init__(self, info: JobInfo) -> None:
        why = info.error or ("cancelled" if info.status is JobStatus.CANCELLED else "no error recorded")
        super().__init__(f"job {info.job_id} {info.status.value}: {why}")
        self.info = info


def write_service_file(runtime_dir: Path, redis_url: str, consumer: str) -> Path:
    path = runtime_dir / SERVICE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"redis_url": redis_url, "pid": os.getpid(), "consumer": consumer}) + "\n")
    tmp.replace(path)
    return path


def read_service_file(runtime_dir: Path) -> dict[str, Any] | None:
    path = runtime_dir / SERVICE_FILE
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    pid = int(doc.get("pid", 0))
    try:
        os.kill(pid, 0)  # is that `vidspec serve` still alive?
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    return doc


def resolve_redis_url(url: str | None = None, settings: Settings | None = None) -> str:
    settings = settings or Settings.from_env()
    if url:
        return url
    if settings.redis_url:
        return settings.redis_url
    doc = read_service_file(settings.runtime_dir)
    if doc is None:
        raise NoService(
            "no Redis to talk to: set VIDSPEC_REDIS_URL, or start `vidspec serve` on this machine "
            f"(it writes {settings.runtime_dir / SERVICE_FILE})"
        )
    return str(doc["redis_url"])


class Client:
    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue

    @classmethod
    def connect(cls, url: str | None = None, settings: Settings | None = None) -> Client:
        settings = settings or Settings.from_env()
        return cls(JobQueue.from_url(resolve_redis_url(url, settings), settings.queue))

    @classmethod
    def from_url(cls, url: str, queue_settings: QueueSettings | None = None) -> Client:
        return cls(JobQueue.from_url(url, queue_settings))

    def close(self) -> None:
        self.queue.close()

    def submit(self, request: JobRequest | dict[str, Any] | str) -> SubmitResult:
        req = request if isinstance(request, JobRequest) else parse_request(request)
        return self.queue.submit(req.job_id, req.to_json())

    def status(self, job_id: str) -> JobInfo:
        return self.queue.info(job_id)

    def result(self, job_id: str) -> dict[str, Any]:
        info = self.queue.info(job_id)
        if info.status is JobStatus.SUCCEEDED:
            assert info.result is not None, "a succeeded job always has a result"
            return info.result
        if info.status.terminal:
            raise JobFailed(info)
        raise JobNotFinished(info)

    def cancel(self, job_id: str) -> JobStatus:
        return self.queue.cancel(job_id)

    def events(self, job_id: str, after: str = "0-0") -> list[Event]:
        return self.queue.events(job_id, after=after)

    def wait(
        self,
        job_id: str,
        timeout_s: float | None = None,
        on_event: Callable[[Event], None] | None = None,
        poll_s: float = 1.0,
    ) -> JobInfo:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last = "0-0"
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout_s:g}s")
            block = poll_s if left is None else max(0.001, min(poll_s, left))
            for ev in self.queue.events(job_id, after=last, block_s=block):
                last = ev.id
                if on_event is not None:
                    on_event(ev)
            # the hash is the truth (events may be trimmed or expire): check it after every wait
            info = self.queue.info(job_id)
            if info.status.terminal:
                return info
