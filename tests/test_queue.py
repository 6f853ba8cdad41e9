"""The Redis job queue (infra/queue.py) against a real redis-server: delivery, recovery, dead letters,
idempotency, cancel, TTLs, events. Consumers here are plain JobQueue calls; a "dead" consumer is one that
read and started a job and then never spoke again."""

from __future__ import annotations

import json
import socket
import time

import pytest
import redis

from infra import keys as K
from infra.config import QueueSettings
from infra.queue import (
    InvalidJobId,
    JobNotFound,
    JobQueue,
    JobStatus,
    validate_job_id,
)
from infra.redis_server import EmbeddedRedis, find_redis_server

pytestmark = pytest.mark.redis

FAST = QueueSettings(claim_idle_s=0.3, heartbeat_s=0.1, max_deliveries=2, result_ttl_s=100)
REQ = json.dumps({"video": {"uri": "/videos/a.mp4"}, "tasks": [{"type": "caption"}]})


@pytest.fixture
def q(redis_db: redis.Redis) -> JobQueue:
    queue = JobQueue(redis_db, FAST)
    yield queue


def _events(q: JobQueue, job_id: str) -> list[str]:
    return [e.type for e in q.events(job_id)]


def test_the_contract_key_names() -> None:
    assert K.JOBS_STREAM == "vidspec:jobs" and K.CONSUMER_GROUP == "vidspec-workers"
    assert K.DLQ_STREAM == "vidspec:dlq"
    assert K.job_key("x1") == "vidspec:job:x1" and K.events_key("x1") == "vidspec:events:x1"
    assert K.JOB_FIELDS == (
        "status", "request", "result", "error", "attempts", "submitted_at", "started_at", "finished_at"
    )  # fmt: skip
    assert [s.value for s in JobStatus] == ["queued", "running", "succeeded", "failed", "cancelled"]
    assert isinstance(JobStatus.QUEUED, str) and JobStatus("failed").terminal


def test_embedded_redis_starts_on_a_free_port_and_stops(tmp_path) -> None:
    assert find_redis_server().is_file()
    with EmbeddedRedis(tmp_path) as srv:
        client = redis.Redis.from_url(srv.url)
        assert client.ping()
        assert int(client.info("server")["redis_version"].split(".")[0]) >= 6
        assert (
            client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
        )
        client.close()
        port = srv.port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1.0)


def test_job_ids_are_validated() -> None:
    assert validate_job_id("job-1.a:b@c_d") == "job-1.a:b@c_d"
    for bad in ("", "a b", "x" * 129, "a/b", None, 3):
        with pytest.raises(InvalidJobId):
            validate_job_id(bad)


def test_submit_is_idempotent_by_job_id(q: JobQueue) -> None:
    first = q.submit("j1", REQ)
    second = q.submit("j1", json.dumps({"video": {"uri": "/other.mp4"}, "tasks": []}))
    assert first.created and first.status is JobStatus.QUEUED
    assert not second.created and second.status is JobStatus.QUEUED
    assert q.r.xlen(K.JOBS_STREAM) == 1
    info = q.info("j1")
    assert info.request == json.loads(REQ) and info.attempts == 0 and info.submitted_at
    assert _events(q, "j1") == ["queued"]


def test_a_started_job_finishes_once_and_its_entry_is_acked_deleted_and_expires(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("c1", 10, block_s=0.5)
    assert d.job_id == "j1" and d.deliveries == 1 and json.loads(d.request) == json.loads(REQ)
    start = q.start(d, "c1")
    assert start.action == "run" and start.attempt == 1 and start.started_at >= start.submitted_at
    info = q.info("j1")
    assert info.status is JobStatus.RUNNING and info.consumer == "c1" and info.started_at
    assert q.finish("j1", 1, JobStatus.SUCCEEDED, result={"answer": 42}) is JobStatus.SUCCEEDED
    assert q.finish("j1", 1, JobStatus.SUCCEEDED, result={"answer": 0}) is None  # written once
    info = q.info("j1")
    assert info.status is JobStatus.SUCCEEDED and info.result == {"answer": 42} and info.finished_at
    assert q.r.xlen(K.JOBS_STREAM) == 0 and q.depth().pending == 0
    assert 0 < q.r.ttl(K.job_key("j1")) <= 100 and 0 < q.r.ttl(K.events_key("j1")) <= 100
    assert _events(q, "j1") == ["queued", "started", "succeeded"]
    assert all(isinstance(e.data, dict) for e in q.events("j1"))


def test_a_dead_consumers_job_is_reclaimed_after_the_idle_time_and_finishes_exactly_once(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("dead", 1)
    assert q.start(d, "dead").attempt == 1
    assert q.reclaim("alive", 10) == []  # not idle long enough yet
    time.sleep(FAST.claim_idle_s + 0.1)
    [again] = q.reclaim("alive", 10)
    assert again.entry_id == d.entry_id and again.deliveries == 2
    start = q.start(again, "alive")
    assert start.action == "run" and start.attempt == 2
    # the "dead" consumer wakes up late: its outcome and its heartbeat are refused
    assert q.finish("j1", 1, JobStatus.SUCCEEDED, result={"by": "dead"}) is None
    assert q.heartbeat("dead", [d.entry_id]) == [d.entry_id]
    assert q.finish("j1", 2, JobStatus.SUCCEEDED, result={"by": "alive"}) is JobStatus.SUCCEEDED
    info = q.info("j1")
    assert info.result == {"by": "alive"} and info.attempts == 2
    assert _events(q, "j1").count("succeeded") == 1


def test_heartbeats_keep_a_long_job_from_being_reclaimed(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("busy", 1)
    q.start(d, "busy")
    t_end = time.monotonic() + 3 * FAST.claim_idle_s
    while time.monotonic() < t_end:
        assert q.heartbeat("busy", [d.entry_id]) == []
        assert q.reclaim("other", 10) == []
        time.sleep(FAST.heartbeat_s)


def test_retry_hands_a_job_back_for_immediate_redelivery(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("c1", 1)
    q.start(d, "c1")
    assert q.retry("j1", 1, "c1", "worker crashed")
    assert not q.retry("j1", 1, "c1", "again")  # stale now
    info = q.info("j1")
    assert info.status is JobStatus.QUEUED and info.last_error == "worker crashed"
    [again] = q.reclaim("c2", 10)  # no waiting for claim_idle_s
    assert again.deliveries == 2 and q.start(again, "c2").attempt == 2
    assert "retry" in _events(q, "j1")


def test_a_job_delivered_more_than_max_deliveries_times_is_dead_lettered(q: JobQueue) -> None:
    q.submit("poison", REQ)
    [d] = q.read("c0", 1)
    for n in range(1, FAST.max_deliveries + 1):  # each consumer starts it and dies
        start = q.start(d, f"c{n}")
        assert start.action == "run" and start.attempt == n
        q.retry("poison", n, f"c{n}", f"crash {n}")
        [d] = q.reclaim(f"c{n + 1}", 10)
    start = q.start(d, "last")
    assert start.action == "dead_letter" and "delivered 3 times" in start.reason
    info = q.info("poison")
    assert info.status is JobStatus.FAILED and info.error.startswith("dead-lettered")
    assert "last error: crash 2" in info.error and info.attempts == FAST.max_deliveries
    [dead] = q.dead_letters()
    assert dead["job_id"] == "poison" and dead["deliveries"] == "3" and json.loads(dead["request"])
    assert q.r.xlen(K.JOBS_STREAM) == 0 and q.depth().pending == 0 and q.depth().dead_letters == 1
    assert _events(q, "poison")[-1] == "dead_lettered"


def test_cancel_a_queued_job_removes_it_from_the_stream(q: JobQueue) -> None:
    q.submit("j1", REQ)
    assert q.cancel("j1") is JobStatus.CANCELLED
    assert q.read("c1", 10) == [] and q.r.xlen(K.JOBS_STREAM) == 0
    assert q.info("j1").status is JobStatus.CANCELLED and q.r.ttl(K.job_key("j1")) > 0
    assert q.cancel("j1") is JobStatus.CANCELLED  # idempotent
    with pytest.raises(JobNotFound):
        q.cancel("never-submitted")


def test_cancel_a_running_job_flags_it_and_its_end_is_cancelled(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("c1", 1)
    q.start(d, "c1")
    assert q.cancel("j1") is JobStatus.RUNNING
    assert q.cancel_requested(["j1", "other"]) == {"j1"}
    # a result that races the cancel loses: the user asked for the job to stop
    assert q.finish("j1", 1, JobStatus.SUCCEEDED, result={"x": 1}) is JobStatus.CANCELLED
    info = q.info("j1")
    assert info.status is JobStatus.CANCELLED and info.result is None
    assert _events(q, "j1")[-2:] == ["cancel_requested", "cancelled"]


def test_a_cancel_requested_before_a_retry_ends_the_job_at_its_next_delivery(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("c1", 1)
    q.start(d, "c1")
    q.cancel("j1")
    q.retry("j1", 1, "c1", "crash")  # the dispatcher died before it saw the cancel
    [again] = q.reclaim("c2", 10)
    assert q.start(again, "c2").action == "skip"
    assert q.info("j1").status is JobStatus.CANCELLED


def test_producers_may_xadd_directly_and_duplicate_entries_of_one_job_run_once(q: JobQueue) -> None:
    body = json.dumps({"job_id": "raw", "video": {"uri": "/a.mp4"}, "tasks": [{"type": "caption"}]})
    q.ensure_group()
    q.r.xadd(K.JOBS_STREAM, {"request": body})
    q.r.xadd(K.JOBS_STREAM, {"job_id": "raw", "request": body})
    first, dup = q.read("c1", 10)
    start = q.start(first, "c1")
    assert start.action == "run" and start.job_id == "raw" and json.loads(start.request)["job_id"] == "raw"
    skipped = q.start(dup, "c1")
    assert skipped.action == "skip" and "duplicate" in skipped.reason
    assert q.info("raw").attempts == 1 and q.r.xlen(K.JOBS_STREAM) == 1  # only the owner's entry is left


def test_malformed_entries_go_to_the_dead_letter_stream(q: JobQueue) -> None:
    q.ensure_group()
    q.r.xadd(K.JOBS_STREAM, {"job_id": "nobody"})  # no request and no submitted job
    q.r.xadd(K.JOBS_STREAM, {"job_id": "bad id!", "request": "{}"})
    for d in q.read("c1", 10):
        assert q.start(d, "c1").action == "dead_letter"
    reasons = [d["reason"] for d in q.dead_letters()]
    assert any("malformed entry" in r for r in reasons) and any("job_id must be" in r for r in reasons)
    assert q.r.xlen(K.JOBS_STREAM) == 0


def test_the_queue_survives_its_stream_being_deleted(q: JobQueue) -> None:
    q.submit("j1", REQ)
    q.r.flushdb()
    assert q.read("c1", 10) == []  # NOGROUP is repaired, not raised
    q.submit("j2", REQ)
    [d] = q.read("c1", 10)
    assert d.job_id == "j2"


def test_events_block_until_a_new_one_arrives(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [first] = q.events("j1")
    t0 = time.monotonic()
    assert q.events("j1", after=first.id, block_s=0.2) == []
    assert time.monotonic() - t0 >= 0.15
    q.event("j1", "progress", step=1, note="half way")
    [ev] = q.events("j1", after=first.id, block_s=1.0)
    assert ev.type == "progress" and ev.data == {"step": 1, "note": "half way"} and ev.ts >= first.ts


def test_idle_consumers_without_pending_jobs_are_pruned(q: JobQueue) -> None:
    q.submit("j1", REQ)
    [d] = q.read("holder", 1)
    q.start(d, "holder")
    q.submit("j2", REQ)
    [d2] = q.read("idle", 1)  # "idle" finishes its job and goes quiet
    q.finish("j2", q.start(d2, "idle").attempt, JobStatus.FAILED, error="x")
    time.sleep(0.05)
    assert q.prune_consumers(keep="me", idle_s=0.01) == ["idle"]  # "holder" still owns a job
