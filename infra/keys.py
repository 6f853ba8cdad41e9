"""Every Redis key, field name and default TTL of the service, in one place (DESIGN.md contract).

Contract (other code and checks rely on these exact names; change only by adding):
- `JOBS_STREAM` = "vidspec:jobs": the job stream; consumer group `CONSUMER_GROUP` = "vidspec-workers".
  An entry carries `job_id` and `request` (the request JSON); producers that XADD directly may omit
  `job_id` (the request's own `job_id`, else `job-<entry id>`, is used).
- `DLQ_STREAM` = "vidspec:dlq": dead letters (jobs delivered more than `max_deliveries` times).
- `job_key(id)` = "vidspec:job:{id}": a hash with the fields of `JOB_FIELDS` (`status`, `request`, `result`,
  `error`, `attempts`, `submitted_at`, `started_at`, `finished_at`) plus the service's own bookkeeping
  fields of `EXTRA_JOB_FIELDS`. Values are JSON or plain strings, never pickles. Times are Unix epoch
  seconds written as decimal strings.
- `events_key(id)` = "vidspec:events:{id}": a stream of progress events, each entry `type`, `ts`, `data`
  (JSON object).
Terminal jobs (and their events) expire after the result TTL; queued and running jobs never expire.
"""

from __future__ import annotations

PREFIX = "vidspec"

JOBS_STREAM = f"{PREFIX}:jobs"
CONSUMER_GROUP = f"{PREFIX}-workers"
DLQ_STREAM = f"{PREFIX}:dlq"

# Fields of an entry in JOBS_STREAM.
ENTRY_JOB_ID = "job_id"
ENTRY_REQUEST = "request"

# Fields of the job hash (contract).
F_STATUS = "status"
F_REQUEST = "request"
F_RESULT = "result"
F_ERROR = "error"
F_ATTEMPTS = "attempts"
F_SUBMITTED_AT = "submitted_at"
F_STARTED_AT = "started_at"
F_FINISHED_AT = "finished_at"
JOB_FIELDS = (F_STATUS, F_REQUEST, F_RESULT, F_ERROR, F_ATTEMPTS, F_SUBMITTED_AT, F_STARTED_AT, F_FINISHED_AT)

# Fields the service adds (additions to the contract, never renames).
F_STREAM_ID = "stream_id"  # the jobs-stream entry that owns this job (later duplicates are ignored)
F_CONSUMER = "consumer"  # the dispatcher running the current attempt
F_CANCEL_REQUESTED = "cancel_requested"  # "1" once a cancel arrived for a running job
F_LAST_ERROR = "last_error"  # why the previous attempt was retried (the job may still succeed)
EXTRA_JOB_FIELDS = (F_STREAM_ID, F_CONSUMER, F_CANCEL_REQUESTED, F_LAST_ERROR)

# Fields of an entry in an events stream.
EV_TYPE = "type"
EV_TS = "ts"
EV_DATA = "data"

# Fields of an entry in DLQ_STREAM.
DLQ_JOB_ID = "job_id"
DLQ_STREAM_ID = "stream_id"
DLQ_DELIVERIES = "deliveries"
DLQ_REASON = "reason"
DLQ_REQUEST = "request"
DLQ_TS = "ts"

# Defaults (overridable through infra.config.Settings).
DEFAULT_RESULT_TTL_S = 7 * 24 * 3600  # terminal jobs and their events
EVENTS_MAXLEN = 1000  # approximate cap of one job's events stream
DLQ_MAXLEN = 10_000  # approximate cap of the dead-letter stream (the job hash keeps the error)


def job_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}:events:{job_id}"
