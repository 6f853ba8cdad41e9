"""The job queue on Redis Streams: submission, delivery, recovery, dead letters, cancel, results, events.

Contract (keys and fields: infra/keys.py; statuses: `JobStatus`; everything stored is JSON or plain text):
- `submit(job_id, request_json)` is idempotent by job id: the first call creates the job hash (`queued`)
  and appends one entry to `vidspec:jobs`, atomically; later calls change nothing and report the existing
  status (until the finished job expires after the result TTL).
- Delivery is at-least-once. Consumers of group `vidspec-workers` get new entries with `read`
  (XREADGROUP) and entries of dead consumers with `reclaim` (XAUTOCLAIM of entries idle longer than
  `claim_idle_s`). A consumer keeps the entries of its running jobs fresh with `heartbeat` (XCLAIM JUSTID
  by the owner only), so a live job is never reclaimed however long it runs.
- `start(delivery, consumer)` decides, atomically, what a delivery means: run it (status `running`,
  `attempts` + 1 = the attempt number, which fences every later write of that attempt), skip it (the job is
  already finished, or the entry is a duplicate of a job owned by another entry), or dead-letter it (it was
  delivered more than `max_deliveries` times: the job fails and a copy goes to `vidspec:dlq`). Skipped and
  dead-lettered entries are acknowledged and deleted. `Start.finished` names the terminal status the step
  itself wrote (dead-lettered: `failed`; a cancel pending at redelivery: `cancelled`), for the metrics.
- Results are idempotent: `finish(job_id, attempt, ...)` writes the outcome only if `attempt` is still the
  job's current attempt and it is running, so a job reclaimed from a slow consumer finishes exactly once.
  Finishing acknowledges and deletes the stream entry and sets the result TTL on the job and its events.
- `retry(job_id, attempt, reason)` puts a running job back (status `queued`, `last_error` = reason) and
  marks its entry idle, so the next `reclaim` sweep of any consumer delivers it again.
- `cancel(job_id)`: a queued job is cancelled at once (its entry is removed); a running job gets
  `cancel_requested` and its dispatcher ends it as `cancelled`; a finished job is left as it is.
- Every status change appends an event to `vidspec:events:{id}` in the same atomic step; progress events
  come from `event(...)`.
Redis >= 6.2 is needed (XAUTOCLAIM). Lua scripts touch several keys, so Redis Cluster is not supported.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis

from infra import keys as K
from infra.config import QueueSettings


class JobStatus(StrEnum):  # a str and an Enum: "queued" == JobStatus.QUEUED
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


TERMINAL = frozenset(s.value for s in JobStatus if s.terminal)


class QueueError(RuntimeError):
    """The queue could not do what was asked (the message says why)."""


class JobNotFound(QueueError, LookupError):
    """No job with this id (never submitted, or finished longer ago than the result TTL)."""


class InvalidJobId(ValueError):
    """A job id must be 1-128 characters of letters, digits and . _ : @ -."""


_JOB_ID_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


def validate_job_id(job_id: object) -> str:
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        raise InvalidJobId(
            f"job_id must be 1-128 characters of letters, digits and . _ : @ -, got {job_id!r}"
        )
    return job_id


def new_job_id() -> str:
    return uuid.uuid4().hex


def _now() -> str:
    return f"{time.time():.6f}"


def entry_time(entry_id: str) -> float:
    """Seconds since the epoch at which Redis created a stream entry (its id's first part is ms)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to a consumer."""

    entry_id: str
    job_id: str | None
    request: str | None  # the request JSON carried by the entry (None if the entry has none)
    deliveries: int  # how often Redis has delivered this entry, this delivery included


@dataclass(frozen=True)
class SubmitResult:
    job_id: str
    created: bool  # False: a job with this id already existed and nothing was changed
    status: JobStatus


@dataclass(frozen=True)
class Start:
    """What `start` decided for a delivery."""

    action: str  # "run" | "skip" | "dead_letter"
    job_id: str
    attempt: int = 0  # for "run": the attempt number (fencing token)
    request: str = ""  # for "run": the request JSON
    reason: str = ""  # for "skip" / "dead_letter"
    submitted_at: float = 0.0  # for "run" (and whenever `finished` is set): Unix time of submission
    started_at: float = 0.0  # for "run": Unix time of this start
    # the terminal status this very step gave the job ("failed" when dead-lettered, "cancelled" when a
    # cancel was pending), "" when it ended no job (run, a duplicate or finished job, a malformed entry)
    finished: str = ""


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    ts: float
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    status: JobStatus
    attempts: int
    submitted_at: float | None
    started_at: float | None
    finished_at: float | None
    error: str | None
    last_error: str | None
    cancel_requested: bool
    request: dict[str, Any] | None
    result: dict[str, Any] | None
    consumer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "status": self.status.value,
            "attempts": self.attempts,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "last_error": self.last_error,
            "cancel_requested": self.cancel_requested,
        }


@dataclass(frozen=True)
class QueueDepth:
    entries: int  # entries in the stream: queued jobs plus delivered, unfinished ones
    pending: int  # delivered to a consumer and not yet acknowledged
    dead_letters: int

    @property
    def waiting(self) -> int:
        return max(0, self.entries - self.pending)


# -- Lua: each status change is one atomic step ----------------------------------------------------

_EVENT = """
local function event(key, maxlen, typ, ts, data)
  redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', typ, 'ts', ts, 'data', data)
end
local function drop_entry(stream, group, sid)
  if sid then
    redis.call('XACK', stream, group, sid)
    redis.call('XDEL', stream, sid)
  end
end
"""

# KEYS: job, events, stream   ARGV: job_id, request, now, events_maxlen
_SUBMIT = (
    _EVENT
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGET', KEYS[1], 'status')}
end
local sid = redis.call('XADD', KEYS[3], '*', 'job_id', ARGV[1], 'request', ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'queued', 'request', ARGV[2], 'attempts', '0',
           'submitted_at', ARGV[3], 'stream_id', sid)
event(KEYS[2], ARGV[4], 'queued', ARGV[3], cjson.encode({stream_id = sid}))
return {1, 'queued'}
"""
)

# KEYS: job, events, stream, dlq
# ARGV: job_id, entry_id, request ('' if none), now, consumer, deliveries, max_deliveries, group,
#       events_maxlen, dlq_maxlen, ttl, submitted_at
_START = (
    _EVENT
    + """
local job, events, stream, dlq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local entry, now, group, emax, ttl = ARGV[2], ARGV[4], ARGV[8], ARGV[9], ARGV[11]
if redis.call('EXISTS', job) == 0 then
  if ARGV[3] == '' then
    local reason = 'malformed entry: no request, and no job ' .. ARGV[1] .. ' was submitted'
    redis.call('XADD', dlq, 'MAXLEN', '~', ARGV[10], '*', 'job_id', ARGV[1], 'stream_id', entry,
               'deliveries', ARGV[6], 'reason', reason, 'request', '', 'ts', now)
    drop_entry(stream, group, entry)
    return {'dead_letter', reason}
  end
  -- a producer XADDed directly: the entry is the submission
  redis.call('HSET', job, 'status', 'queued', 'request', ARGV[3], 'attempts', '0',
             'submitted_at', ARGV[12], 'stream_id', entry)
  event(events, emax, 'queued', ARGV[12], cjson.encode({stream_id = entry}))
end
local sid = redis.call('HGET', job, 'stream_id')
if not sid then
  redis.call('HSET', job, 'stream_id', entry)
  sid = entry
end
local status = redis.call('HGET', job, 'status')
if sid ~= entry then
  drop_entry(stream, group, entry)
  return {'skip', 'duplicate entry ' .. entry .. ' of job owned by entry ' .. sid .. ' (' .. status .. ')'}
end
if status == 'succeeded' or status == 'failed' or status == 'cancelled' then
  drop_entry(stream, group, entry)
  return {'skip', 'already ' .. status}
end
if redis.call('HGET', job, 'cancel_requested') == '1' then
  redis.call('HSET', job, 'status', 'cancelled', 'finished_at', now)
  event(events, emax, 'cancelled', now, cjson.encode({reason = 'cancel requested before a retry'}))
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', events, ttl)
  drop_entry(stream, group, entry)
  return {'skip', 'cancelled', 'cancelled', redis.call('HGET', job, 'submitted_at') or ''}
end
if tonumber(ARGV[6]) > tonumber(ARGV[7]) then
  local last = redis.call('HGET', job, 'last_error')
  local reason = 'delivered ' .. ARGV[6] .. ' times (max_deliveries ' .. ARGV[7] .. ')'
  if last and last ~= '' then reason = reason .. '; last error: ' .. last end
  redis.call('HSET', job, 'status', 'failed', 'finished_at', now, 'error', 'dead-lettered: ' .. reason)
  redis.call('XADD', dlq, 'MAXLEN', '~', ARGV[10], '*', 'job_id', ARGV[1], 'stream_id', entry,
             'deliveries', ARGV[6], 'reason', reason,
             'request', redis.call('HGET', job, 'request') or '', 'ts', now)
  event(events, emax, 'dead_lettered', now, cjson.encode({reason = reason, deliveries = tonumber(ARGV[6])}))
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', events, ttl)
  drop_entry(stream, group, entry)
  return {'dead_letter', reason, 'failed', redis.call('HGET', job, 'submitted_at') or ''}
end
local attempt = redis.call('HINCRBY', job, 'attempts', 1)
redis.call('HSET', job, 'status', 'running', 'started_at', now, 'consumer', ARGV[5])
event(events, emax, 'started', now,
      cjson.encode({attempt = attempt, consumer = ARGV[5], deliveries = tonumber(ARGV[6])}))
return {'run', tostring(attempt), redis.call('HGET', job, 'request'), redis.call('HGET', job, 'submitted_at')}
"""
)

# KEYS: job, events, stream   ARGV: attempt, status, result, error, now, ttl, group, events_maxlen, data
_FINISH = (
    _EVENT
    + """
local job, events = KEYS[1], KEYS[2]
if redis.call('HGET', job, 'status') ~= 'running' or redis.call('HGET', job, 'attempts') ~= ARGV[1] then
  return false
end
local final = ARGV[2]
if final == 'succeeded' and redis.call('HGET', job, 'cancel_requested') == '1' then
  final = 'cancelled'
end
redis.call('HSET', job, 'status', final, 'finished_at', ARGV[5])
if final == 'succeeded' and ARGV[3] ~= '' then redis.call('HSET', job, 'result', ARGV[3]) end
if final == 'failed' and ARGV[4] ~= '' then redis.call('HSET', job, 'error', ARGV[4]) end
event(events, ARGV[8], final, ARGV[5], ARGV[9])
redis.call('EXPIRE', job, ARGV[6])
redis.call('EXPIRE', events, ARGV[6])
drop_entry(KEYS[3], ARGV[7], redis.call('HGET', job, 'stream_id'))
return final
"""
)

# KEYS: job, events, stream   ARGV: attempt, reason, now, group, consumer, claim_idle_ms, events_maxlen
_RETRY = (
    _EVENT
    + """
local job = KEYS[1]
if redis.call('HGET', job, 'status') ~= 'running' or redis.call('HGET', job, 'attempts') ~= ARGV[1] then
  return 0
end
redis.call('HSET', job, 'status', 'queued', 'last_error', ARGV[2])
redis.call('HDEL', job, 'consumer')
event(KEYS[2], ARGV[7], 'retry', ARGV[3], cjson.encode({attempt = tonumber(ARGV[1]), reason = ARGV[2]}))
local sid = redis.call('HGET', job, 'stream_id')
if sid then
  -- back-date the entry so that the next reclaim sweep (of any consumer) delivers it again
  redis.call('XCLAIM', KEYS[3], ARGV[4], ARGV[5], 0, sid, 'IDLE', ARGV[6], 'JUSTID')
end
return 1
"""
)

# KEYS: job, events, stream   ARGV: now, ttl, group, events_maxlen
_CANCEL = (
    _EVENT
    + """
local job = KEYS[1]
if redis.call('EXISTS', job) == 0 then return 'missing' end
local status = redis.call('HGET', job, 'status')
if status == 'queued' then
  redis.call('HSET', job, 'status', 'cancelled', 'finished_at', ARGV[1])
  event(KEYS[2], ARGV[4], 'cancelled', ARGV[1], cjson.encode({reason = 'cancelled while queued'}))
  redis.call('EXPIRE', job, ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  drop_entry(KEYS[3], ARGV[3], redis.call('HGET', job, 'stream_id'))
  return 'cancelled'
end
if status == 'running' and redis.call('HGET', job, 'cancel_requested') ~= '1' then
  redis.call('HSET', job, 'cancel_requested', '1')
  event(KEYS[2], ARGV[4], 'cancel_requested', ARGV[1], '{}')
end
return status
"""
)

# KEYS: stream   ARGV: group, consumer, entry ids...   -> the ids this consumer no longer owns
_HEARTBEAT = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


def _float(v: str | None) -> float | None:
    return float(v) if v not in (None, "") else None


def _json(v: str | None) -> dict[str, Any] | None:
    return json.loads(v) if v else None


class JobQueue:
    """See the module docstring. Thread-compatible (one instance per thread, or a thread-safe client)."""

    def __init__(self, client: redis.Redis, settings: QueueSettings | None = None) -> None:
        if not client.get_connection_kwargs().get("decode_responses"):
            raise QueueError("JobQueue needs a redis client created with decode_responses=True")
        self.r = client
        self.settings = settings or QueueSettings()
        self._group_ready = False
        self._submit = client.register_script(_SUBMIT)
        self._start = client.register_script(_START)
        self._finish = client.register_script(_FINISH)
        self._retry = client.register_script(_RETRY)
        self._cancel = client.register_script(_CANCEL)
        self._heartbeat = client.register_script(_HEARTBEAT)

    @classmethod
    def from_url(cls, url: str, settings: QueueSettings | None = None) -> JobQueue:
        return cls(redis.Redis.from_url(url, decode_responses=True, health_check_interval=30), settings)

    def close(self) -> None:
        self.r.close()

    # -- producer side ----------------------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create the stream and consumer group if missing (from id 0: earlier entries are delivered too)."""
        try:
            self.r.xgroup_create(K.JOBS_STREAM, K.CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def submit(self, job_id: str, request_json: str) -> SubmitResult:
        validate_job_id(job_id)
        json.loads(request_json)  # stored as given, but it must be JSON
        if not self._group_ready:
            self.ensure_group()
        created, status = self._submit(
            keys=[K.job_key(job_id), K.events_key(job_id), K.JOBS_STREAM],
            args=[job_id, request_json, _now(), K.EVENTS_MAXLEN],
        )
        return SubmitResult(job_id=job_id, created=bool(created), status=JobStatus(status))

    def cancel(self, job_id: str) -> JobStatus:
        """Cancel a job; returns its status afterwards (`running` means: cancel requested, ending soon)."""
        validate_job_id(job_id)
        status = self._cancel(
            keys=[K.job_key(job_id), K.events_key(job_id), K.JOBS_STREAM],
            args=[_now(), self.settings.result_ttl_s, K.CONSUMER_GROUP, K.EVENTS_MAXLEN],
        )
        if status == "missing":
            raise JobNotFound(f"no job {job_id!r} (never submitted, or expired after the result TTL)")
        return JobStatus(status)

    def info(self, job_id: str) -> JobInfo:
        validate_job_id(job_id)
        h = self.r.hgetall(K.job_key(job_id))
        if not h:
            raise JobNotFound(f"no job {job_id!r} (never submitted, or expired after the result TTL)")
        return JobInfo(
            job_id=job_id,
            status=JobStatus(h[K.F_STATUS]),
            attempts=int(h.get(K.F_ATTEMPTS) or 0),
            submitted_at=_float(h.get(K.F_SUBMITTED_AT)),
            started_at=_float(h.get(K.F_STARTED_AT)),
            finished_at=_float(h.get(K.F_FINISHED_AT)),
            error=h.get(K.F_ERROR) or None,
            last_error=h.get(K.F_LAST_ERROR) or None,
            cancel_requested=h.get(K.F_CANCEL_REQUESTED) == "1",
            request=_json(h.get(K.F_REQUEST)),
            result=_json(h.get(K.F_RESULT)),
            consumer=h.get(K.F_CONSUMER) or None,
        )

    def events(
        self, job_id: str, after: str = "0-0", block_s: float | None = None, count: int = 100
    ) -> list[Event]:
        """Events after id `after`; with `block_s`, wait up to that long for the first new one."""
        block = None if block_s is None else max(1, int(block_s * 1000))
        resp = self.r.xread({K.events_key(job_id): after}, count=count, block=block)
        out: list[Event] = []
        for _, entries in resp or []:
            for eid, f in entries:
                out.append(
                    Event(eid, f.get(K.EV_TYPE, ""), float(f.get(K.EV_TS, 0)), _json(f.get(K.EV_DATA)) or {})
                )
        return out

    def depth(self) -> QueueDepth:
        with self.r.pipeline(transaction=False) as p:
            p.xlen(K.JOBS_STREAM)
            p.xlen(K.DLQ_STREAM)
            entries, dead = p.execute()
        pending = 0
        if entries:
            try:
                pending = int(self.r.xpending(K.JOBS_STREAM, K.CONSUMER_GROUP)["pending"])
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
        return QueueDepth(entries=int(entries), pending=pending, dead_letters=int(dead))

    def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The newest dead letters first: job_id, stream_id, deliveries, reason, request, ts."""
        return [{"id": eid, **f} for eid, f in self.r.xrevrange(K.DLQ_STREAM, count=count)]

    # -- consumer side ----------------------------------------------------------------------------
    def _with_group(self, fn: Any) -> Any:
        if not self._group_ready:
            self.ensure_group()
        try:
            return fn()
        except redis.ResponseError as exc:  # the stream or group was deleted under us (e.g. FLUSHDB)
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()
            return fn()

    def read(self, consumer: str, count: int, block_s: float | None = None) -> list[Delivery]:
        """New entries for `consumer` (XREADGROUP '>'); with `block_s`, wait that long for the first."""
        if count < 1:
            return []
        block = None if not block_s else max(1, int(block_s * 1000))
        resp = self._with_group(
            lambda: self.r.xreadgroup(
                K.CONSUMER_GROUP, consumer, {K.JOBS_STREAM: ">"}, count=count, block=block
            )
        )
        return [self._delivery(eid, f, 1) for _, entries in resp or [] for eid, f in entries]

    def reclaim(self, consumer: str, count: int, min_idle_s: float | None = None) -> list[Delivery]:
        """Take over up to `count` entries idle longer than `min_idle_s` (default: claim_idle_s)."""
        if count < 1:
            return []
        idle_ms = int(1000 * (self.settings.claim_idle_s if min_idle_s is None else min_idle_s))
        resp = self._with_group(
            lambda: self.r.xautoclaim(
                K.JOBS_STREAM, K.CONSUMER_GROUP, consumer, idle_ms, start_id="0-0", count=count
            )
        )
        claimed = [(eid, f) for eid, f in resp[1] if eid]
        if not claimed:
            return []
        with self.r.pipeline(transaction=False) as p:
            for eid, _ in claimed:
                p.xpending_range(K.JOBS_STREAM, K.CONSUMER_GROUP, min=eid, max=eid, count=1)
            pend = p.execute()
        out = []
        for (eid, f), rows in zip(claimed, pend, strict=True):
            times = int(rows[0]["times_delivered"]) if rows else 1
            if f is None:  # deleted from the stream while pending: nothing to run
                self.r.xack(K.JOBS_STREAM, K.CONSUMER_GROUP, eid)
                continue
            out.append(self._delivery(eid, f, times))
        return out

    @staticmethod
    def _delivery(entry_id: str, fields: dict[str, str], deliveries: int) -> Delivery:
        return Delivery(
            entry_id=entry_id,
            job_id=fields.get(K.ENTRY_JOB_ID) or None,
            request=fields.get(K.ENTRY_REQUEST) or None,
            deliveries=deliveries,
        )

    def start(self, delivery: Delivery, consumer: str) -> Start:
        """Decide what to do with a delivery (run / skip / dead-letter); see the module docstring."""
        job_id = delivery.job_id
        if job_id is None and delivery.request:
            try:
                job_id = json.loads(delivery.request).get("job_id")
            except (json.JSONDecodeError, AttributeError):
                job_id = None
        if job_id is None:
            job_id = "job-" + delivery.entry_id
        try:
            validate_job_id(job_id)
        except InvalidJobId as exc:
            self.dead_letter_entry(delivery, f"malformed entry: {exc}")
            return Start("dead_letter", str(job_id), reason=str(exc))
        now = _now()
        res = self._start(
            keys=[K.job_key(job_id), K.events_key(job_id), K.JOBS_STREAM, K.DLQ_STREAM],
            args=[
                job_id, delivery.entry_id, delivery.request or "", now, consumer, delivery.deliveries,
                self.settings.max_deliveries, K.CONSUMER_GROUP, K.EVENTS_MAXLEN, K.DLQ_MAXLEN,
                self.settings.result_ttl_s, f"{entry_time(delivery.entry_id):.6f}",
            ],
        )  # fmt: skip
        if res[0] == "run":
            return Start(
                "run",
                job_id,
                attempt=int(res[1]),
                request=res[2] or "",
                submitted_at=float(res[3] or now),
                started_at=float(now),
            )
        finished = res[2] if len(res) > 2 else ""
        submitted = res[3] if len(res) > 3 else ""
        return Start(res[0], job_id, reason=res[1], finished=finished, submitted_at=float(submitted or 0.0))

    def dead_letter_entry(self, delivery: Delivery, reason: str) -> None:
        """Move an entry that names no usable job straight to the dead-letter stream."""
        with self.r.pipeline(transaction=True) as p:
            p.xadd(
                K.DLQ_STREAM,
                {
                    K.DLQ_JOB_ID: delivery.job_id or "",
                    K.DLQ_STREAM_ID: delivery.entry_id,
                    K.DLQ_DELIVERIES: str(delivery.deliveries),
                    K.DLQ_REASON: reason,
                    K.DLQ_REQUEST: delivery.request or "",
                    K.DLQ_TS: _now(),
                },
                maxlen=K.DLQ_MAXLEN,
                approximate=True,
            )
            p.xack(K.JOBS_STREAM, K.CONSUMER_GROUP, delivery.entry_id)
            p.xdel(K.JOBS_STREAM, delivery.entry_id)
            p.execute()

    def heartbeat(self, consumer: str, entry_ids: Iterable[str]) -> list[str]:
        """Refresh the idle time of our pending entries; return those another consumer has taken over."""
        ids = list(entry_ids)
        if not ids:
            return []
        return list(self._heartbeat(keys=[K.JOBS_STREAM], args=[K.CONSUMER_GROUP, consumer, *ids]))

    def finish(
        self,
        job_id: str,
        attempt: int,
        status: JobStatus,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> JobStatus | None:
        """Write the outcome of `attempt`; None if that attempt is stale (the job moved on without it)."""
        if not status.terminal:
            raise ValueError(f"finish needs a terminal status, got {status.value}")
        event_data = dict(data or {})
        event_data["attempt"] = attempt
        if error:
            event_data["error"] = error
        final = self._finish(
            keys=[K.job_key(job_id), K.events_key(job_id), K.JOBS_STREAM],
            args=[
                str(attempt), status.value, json.dumps(result) if result is not None else "", error or "",
                _now(), self.settings.result_ttl_s, K.CONSUMER_GROUP, K.EVENTS_MAXLEN, json.dumps(event_data),
            ],
        )  # fmt: skip
        return JobStatus(final) if final else None

    def retry(self, job_id: str, attempt: int, consumer: str, reason: str) -> bool:
        """Give a running job back for another delivery; False if `attempt` is stale."""
        ok = self._retry(
            keys=[K.job_key(job_id), K.events_key(job_id), K.JOBS_STREAM],
            args=[
                str(attempt), reason, _now(), K.CONSUMER_GROUP, consumer,
                int(self.settings.claim_idle_s * 1000) + 1, K.EVENTS_MAXLEN,
            ],
        )  # fmt: skip
        return bool(ok)

    def cancel_requested(self, job_ids: Iterable[str]) -> set[str]:
        ids = list(job_ids)
        if not ids:
            return set()
        with self.r.pipeline(transaction=False) as p:
            for j in ids:
                p.hget(K.job_key(j), K.F_CANCEL_REQUESTED)
            flags = p.execute()
        return {j for j, f in zip(ids, flags, strict=True) if f == "1"}

    def event(self, job_id: str, type_: str, **data: Any) -> None:
        """Append a progress event (best effort ordering with status events: both are XADDs)."""
        self.r.xadd(
            K.events_key(job_id),
            {K.EV_TYPE: type_, K.EV_TS: _now(), K.EV_DATA: json.dumps(data)},
            maxlen=K.EVENTS_MAXLEN,
            approximate=True,
        )

    def prune_consumers(self, keep: str, idle_s: float) -> list[str]:
        """Delete group consumers with nothing pending that have been silent for `idle_s`."""
        try:
            consumers = self.r.xinfo_consumers(K.JOBS_STREAM, K.CONSUMER_GROUP)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc):
                return []
            raise
        gone = []
        for c in consumers:
            if c["name"] != keep and int(c["pending"]) == 0 and int(c["idle"]) > idle_s * 1000:
                self.r.xgroup_delconsumer(K.JOBS_STREAM, K.CONSUMER_GROUP, c["name"])
                gone.append(c["name"])
        return gone
