"""The whole service against a real redis-server and a real local Ray (one shared instance): the dispatcher
consuming the stream, the ingest and video-worker actors, results, events, and every failure path.

The only injected fault is `FaultyCore`, a real `VideoWorkerCore` whose process exits (`os._exit`) on two
magic questions, to crash a worker actor mid-task the way an OOM kill or a segfault would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
import redis

from decoders.train.world import make_video
from infra import keys as K
from infra.config import InputPolicy, QueueSettings, Settings, WorkerSettings
from infra.queue import JobInfo, JobQueue, JobStatus
from pipeline.client import Client
from pipeline.dispatcher import Dispatcher, WorkerPool
from workers.video_worker import VideoWorkerCore

pytestmark = [pytest.mark.redis, pytest.mark.ray]

CRASH_ALWAYS = "crash the worker"
CRASH_ONCE = "crash the worker on the first attempt"
REPO = Path(__file__).resolve().parent.parent


class FaultyCore(VideoWorkerCore):
    """A real worker whose process dies on a magic question (fault injection, not a mock)."""

    def answer(self, job_id, source, task, decoding, remaining_s=None, attempt=1):  # type: ignore[override]
        if task.question == CRASH_ALWAYS or (task.question == CRASH_ONCE and attempt == 1):
            os._exit(3)
        return super().answer(job_id, source, task, decoding, remaining_s, attempt)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker process cannot import tests/


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service-media")


@pytest.fixture(scope="module")
def settings(media: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        runtime_dir=tmp_path_factory.mktemp("service-runtime"),
        queue=QueueSettings(
            claim_idle_s=1.0,
            heartbeat_s=0.25,
            reclaim_every_s=0.2,
            max_deliveries=2,
            block_s=0.1,
            poll_s=0.01,
        ),
        input=InputPolicy(roots=(media,)),
        workers=WorkerSettings(
            max_in_flight=4, session_cache_bytes=256 << 20, device="cpu", worker_cpus=0.5, ingest_cpus=0.5
        ),
    )


@pytest.fixture(scope="module")
def pool(ray_session: object, settings: Settings, tiny_checkpoints: dict[str, Path]) -> Iterator[WorkerPool]:
    p = WorkerPool.start(settings, tiny_checkpoints["qwen2_vl"], core_cls=FaultyCore)
    yield p
    p.shutdown()


_counter = iter(range(10**6))


def new_video(media: Path, seconds: float = 4.0) -> str:
    """A fresh video file (a fresh file is a fresh video key: never cached by an earlier test)."""
    n = next(_counter)
    return str(make_video(media / f"v{n}.mp4", seconds, 4, 112, 112, seed=n))


def request(uri: str, *questions: str, caption: bool = False, **extra: object) -> dict:
    tasks = ([{"type": "caption"}] if caption else []) + [{"type": "qa", "question": q} for q in questions]
    decoding = {"max_new_tokens": 12, **extra.pop("decoding", {})}  # type: ignore[dict-item]
    return {"video": {"uri": uri}, "tasks": tasks, "decoding": decoding, **extra}


@dataclass
class Service:
    queue: JobQueue
    client: Client
    settings: Settings
    pool: WorkerPool
    dispatcher: Dispatcher | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)

    def start(self) -> Dispatcher:
        self.dispatcher = Dispatcher(self.queue, self.settings, self.pool, consumer="test-dispatcher")

        def run() -> None:
            try:
                assert self.dispatcher is not None
                self.dispatcher.run(self.stop_event)
            except BaseException as exc:  # surfaced by wait() and by the fixture's teardown
                self.errors.append(exc)
                raise

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self.dispatcher

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def wait(self, job_id: str, timeout_s: float = 90.0) -> JobInfo:
        try:
            return self.client.wait(job_id, timeout_s=timeout_s, poll_s=0.2)
        finally:
            assert not self.errors, f"the dispatcher thread died: {self.errors!r}"

    def events(self, job_id: str) -> list[str]:
        return [e.type for e in self.client.events(job_id)]

    def worker_stats(self) -> dict:
        return ray.get(self.pool.video[0].stats.remote()).to_dict()

    def metric(self, name: str, **labels: str) -> float:
        """A sample of this dispatcher's metrics (0 when the series does not exist)."""
        assert self.dispatcher is not None
        return self.dispatcher.metrics.registry.get_sample_value(name, labels) or 0.0

    def metric_reaches(self, value: float, name: str, timeout: float = 10.0, **labels: str) -> float:
        """The metric once it equals `value`, or its last sample after `timeout` seconds. The dispatcher
        records an outcome right after writing it to Redis, so a client that has just seen the status may
        read the counter a moment early."""
        deadline = time.monotonic() + timeout
        while (got := self.metric(name, **labels)) != value and time.monotonic() < deadline:
            time.sleep(0.01)
        return got


@pytest.fixture
def service(redis_db: redis.Redis, settings: Settings, pool: WorkerPool) -> Iterator[Service]:
    queue = JobQueue(redis_db, settings.queue)
    svc = Service(
        queue=queue, client=Client(JobQueue(redis_db, settings.queue)), settings=settings, pool=pool
    )
    yield svc
    svc.stop()
    assert not svc.errors, f"the dispatcher thread died: {svc.errors!r}"


# -- happy paths ---------------------------------------------------------------------------------
def test_caption_and_qa_jobs_go_from_submit_to_result_with_speculative_stats(
    service: Service, media: Path
) -> None:
    service.start()
    uri = new_video(media)
    sub = service.client.submit(request(uri, "how many objects appear ?", caption=True, job_id="first"))
    assert sub.created and sub.status is JobStatus.QUEUED
    info = service.wait("first")
    assert info.status is JobStatus.SUCCEEDED, info.error
    assert info.attempts == 1 and info.submitted_at <= info.started_at <= info.finished_at
    result = service.client.result("first")
    video = result["video"]
    assert (
        video["uri"] == uri
        and video["cache"] == "miss"
        and video["visual_tokens"] > 0
        and video["frames"] > 0
    )
    assert video["ingest_s"] > 0 and video["encode_s"] > 0 and video["prefill_s"] > 0
    caption, qa = result["tasks"]
    assert caption["type"] == "caption" and caption["question"] == "describe the video ."
    assert qa["type"] == "qa" and qa["question"] == "how many objects appear ?"
    for t in (caption, qa):
        assert t["method"] == "std" and t["requested_method"] == "auto"  # the concrete method is recorded
        assert isinstance(t["text"], str) and t["num_tokens"] == len(t["tokens"]) >= 1
        assert t["stats"]["new_tokens"] == t["num_tokens"] and "mean_accepted_length" in t["stats"]
        assert t["stats"]["num_drafts"] >= 0 and "accepted_per_pos" in t["stats"]
        assert t["ttft_s"] > 0 and t["decode_s"] >= 0 and t["tokens_per_target_forward"] >= 1.0
    assert result["timings"]["queue_s"] >= 0 and result["timings"]["time_to_first_token_s"] > 0
    assert service.events("first") == [
        "queued",
        "started",
        "ingested",
        "session",
        "task",
        "task",
        "succeeded",
    ]


def test_a_second_question_on_the_same_video_reuses_the_cached_session(service: Service, media: Path) -> None:
    service.start()
    uri = new_video(media)
    service.client.submit(request(uri, "what is the first object ?", job_id="q1"))
    assert service.wait("q1").status is JobStatus.SUCCEEDED
    before = service.worker_stats()
    service.client.submit(request(uri, "what is the last object ?", job_id="q2"))
    assert service.wait("q2").status is JobStatus.SUCCEEDED
    after = service.worker_stats()
    first, second = service.client.result("q1")["video"], service.client.result("q2")["video"]
    assert first["cache"] == "miss" and first["prefill_s"] > 0
    assert second["cache"] == "hit" and second["prefill_s"] == second["encode_s"] == second["ingest_s"] == 0
    assert second["visual_tokens"] == first["visual_tokens"]
    assert after["sessions_built"] == before["sessions_built"]  # no second vision tower + prefill
    assert (
        after["session_hits"] > before["session_hits"]
        and after["tasks_answered"] == before["tasks_answered"] + 1
    )
    assert "ingested" not in service.events("q2")  # the cached video is not even decoded again


# -- at-least-once delivery, exactly-once results --------------------------------------------------
def test_a_consumer_killed_mid_job_is_reclaimed_and_the_job_finishes_exactly_once(
    service: Service, media: Path, redis_url: str
) -> None:
    service.client.submit(request(new_video(media), "what is the first object ?", job_id="orphan"))
    consumer = (
        "import sys, time\n"
        "from infra.config import QueueSettings\nfrom infra.queue import JobQueue\n"
        f"q = JobQueue.from_url({redis_url!r}, QueueSettings(claim_idle_s=1.0, heartbeat_s=0.25))\n"
        "[d] = q.read('doomed-consumer', 1, block_s=5)\n"
        "print(q.start(d, 'doomed-consumer').attempt, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", consumer], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "1"  # it holds attempt 1
        assert service.client.status("orphan").status is JobStatus.RUNNING
    finally:
        proc.kill()  # SIGKILL mid-job: no cleanup, no ack
        proc.wait(timeout=10)
    service.start()
    info = service.wait("orphan")
    assert info.status is JobStatus.SUCCEEDED and info.attempts == 2
    events = service.events("orphan")
    assert events.count("started") == 2 and events.count("succeeded") == 1
    # the killed consumer's attempt can never write an outcome any more
    assert service.queue.finish("orphan", 1, JobStatus.FAILED, error="zombie") is None
    assert service.client.status("orphan").status is JobStatus.SUCCEEDED
    assert service.queue.depth().entries == 0


def test_a_worker_crash_mid_task_restarts_the_actor_and_retries_the_job(
    service: Service, media: Path
) -> None:
    service.start()
    service.client.submit(request(new_video(media), CRASH_ONCE, job_id="crashy"))
    info = service.wait("crashy")
    assert info.status is JobStatus.SUCCEEDED and info.attempts == 2
    assert "task failed" in (info.last_error or "")  # why attempt 1 was retried
    assert service.events("crashy").count("retry") == 1
    assert service.client.result("crashy")["video"]["cache"] == "miss"  # the restarted actor starts empty
    assert service.metric("vidspec_worker_restarts_total") == 1
    assert service.metric_reaches(1, "vidspec_jobs_total", status="succeeded") == 1
    assert service.metric("vidspec_jobs_total", status="failed") == 0


def test_a_duplicate_submission_of_one_job_id_runs_once(service: Service, media: Path) -> None:
    service.start()
    before = service.worker_stats()["tasks_answered"]
    body = request(new_video(media), "what is the first object ?", "what is the last object ?", job_id="dup")
    assert service.client.submit(body).created
    assert not service.client.submit(body).created
    # an at-least-once producer XADDs the same job again, straight into the stream
    service.queue.r.xadd(
        K.JOBS_STREAM, {"job_id": "dup", "request": json.dumps(service.client.status("dup").request)}
    )
    assert service.wait("dup").status is JobStatus.SUCCEEDED
    deadline = time.monotonic() + 10
    while service.queue.depth().entries and time.monotonic() < deadline:  # the duplicate entry is dropped
        time.sleep(0.05)
    assert service.queue.depth().entries == 0
    assert service.events("dup").count("started") == 1 and service.client.status("dup").attempts == 1
    assert service.worker_stats()["tasks_answered"] == before + 2


# -- cancel, timeout, poison, bad input ---------------------------------------------------------------
LONG = {"max_new_tokens": 1024, "ignore_eos": True}
# a job of many such answers: 8 x 1024 tokens of the tiny model can decode in under a second on an idle core
MANY = [f"question {i} ?" for i in range(32)]


def test_cancel_a_queued_job_and_a_running_job(service: Service, media: Path) -> None:
    uri = new_video(media)
    service.client.submit(request(uri, "never runs", job_id="queued-then-cancelled"))
    assert service.client.cancel("queued-then-cancelled") is JobStatus.CANCELLED
    service.start()
    service.client.submit(request(uri, *MANY, job_id="long", decoding=LONG))
    deadline = time.monotonic() + 60
    while "task" not in service.events("long") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.client.cancel("long") is JobStatus.RUNNING  # requested; the dispatcher ends it
    info = service.wait("long")
    assert info.status is JobStatus.CANCELLED and info.result is None
    assert service.events("long").count("task") < 8  # stopped mid-way, not run to the end
    service.client.submit(request(uri, "what is the first object ?", job_id="after-cancel"))
    assert service.wait("after-cancel").status is JobStatus.SUCCEEDED
    assert service.client.status("queued-then-cancelled").status is JobStatus.CANCELLED
    assert "started" not in service.events("queued-then-cancelled")
    # the dispatcher counts the outcomes it wrote: the queued job was cancelled by the client alone
    assert service.metric_reaches(1, "vidspec_jobs_total", status="cancelled") == 1
    assert service.metric_reaches(1, "vidspec_jobs_total", status="succeeded") == 1


def test_a_job_running_past_its_timeout_fails_with_a_clear_error(service: Service, media: Path) -> None:
    service.start()
    uri = new_video(media)
    service.client.submit(request(uri, *MANY, job_id="slow", decoding=LONG, timeout_s=1.0))
    info = service.wait("slow")
    assert info.status is JobStatus.FAILED and "timed out" in info.error and "limit 1s" in info.error
    assert info.finished_at - info.started_at < 8.0  # stopped at the limit, not after 32 x 1024 tokens
    service.client.submit(request(uri, "what is the first object ?", job_id="after-timeout"))
    assert service.wait("after-timeout").status is JobStatus.SUCCEEDED
    assert service.metric_reaches(1, "vidspec_jobs_total", status="failed") == 1


def test_a_poisoned_job_ends_in_the_dead_letter_stream_after_max_deliveries(
    service: Service, media: Path
) -> None:
    service.start()
    uri = new_video(media)
    service.client.submit(request(uri, CRASH_ALWAYS, job_id="poison"))
    info = service.wait("poison")
    n = service.settings.queue.max_deliveries
    assert info.status is JobStatus.FAILED and info.error.startswith("dead-lettered") and info.attempts == n
    [dead] = service.queue.dead_letters()
    assert dead["job_id"] == "poison" and int(dead["deliveries"]) == n + 1 and "task failed" in dead["reason"]
    assert service.events("poison").count("retry") == n and service.events("poison")[-1] == "dead_lettered"
    service.client.submit(request(uri, "what is the first object ?", job_id="after-poison"))
    assert service.wait("after-poison").status is JobStatus.SUCCEEDED  # the service lives on
    assert service.metric_reaches(1, "vidspec_jobs_dead_lettered_total") == 1
    assert service.metric_reaches(1, "vidspec_jobs_total", status="failed") == 1  # the dead-lettered job
    assert service.metric("vidspec_worker_restarts_total") == n  # one crash per delivery


def test_bad_videos_and_requests_fail_their_jobs_clearly_and_the_next_job_succeeds(
    service: Service, media: Path, tmp_path: Path
) -> None:
    service.start()
    corrupt = media / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(4096))
    outside = tmp_path / "outside.mp4"
    outside.write_bytes(Path(new_video(media)).read_bytes())
    bad = {
        "corrupt": (str(corrupt), "cannot read video"),
        "missing": (str(media / "missing.mp4"), "not found"),
        "outside": (str(outside), "not under an allowed input root"),
        "web": ("http://127.0.0.1:9/clip.mp4", "VIDSPEC_ALLOW_HTTP=1"),
    }
    for job_id, (uri, _) in bad.items():
        service.client.submit(request(uri, "what is the first object ?", job_id=job_id))
    service.queue.r.xadd(
        K.JOBS_STREAM, {"job_id": "garbled", "request": '{"video": {"uri": "/x.mp4"}, "tasks": []}'}
    )
    service.client.submit(request(new_video(media), "what is the first object ?", job_id="good"))
    for job_id, (_, reason) in bad.items():
        info = service.wait(job_id)
        assert info.status is JobStatus.FAILED and reason in info.error, (job_id, info.error)
        assert info.attempts == 1  # a bad input is not retried
    garbled = service.wait("garbled")
    assert garbled.status is JobStatus.FAILED and "invalid request: tasks" in garbled.error
    assert service.wait("good").status is JobStatus.SUCCEEDED
