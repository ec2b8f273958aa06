"""Every Redis key Vigil owns, in one place. Celery's own keys (queues `vigil.pool.*`, `unacked*`,
`celery-task-meta-*`, which expire after result_ttl) live beside these in the same database;
Vigil's all start with `vigil:`. No key outlives what it describes: each expires or is deleted
when that ends, and an empty set or zset vanishes in the command that removed its last member
(tests/test_no_leaks_e2e.py).

| key                         | type | TTL                         | owner / meaning                          |
| --------------------------- | ---- | --------------------------- | ---------------------------------------- |
| vigil:req:{request_id}      | hash | none while live; result_ttl | producer creates (PENDING); worker runs  |
|                             |      | once terminal               | it; first terminal writer wins           |
| vigil:inflight:{instance}   | set  | none; dropped at unregister | request ids a worker instance is running |
| vigil:worker:{instance}     | hash | none; dropped at unregister | worker registry entry + engine stats,    |
|                             |      | or by the reaper            | refreshed by the heartbeat; has_pinged 0 |
|                             |      |                             | until the worker is ready, then 1        |
| vigil:workers               | zset | none                        | instance id -> last_seen (unix seconds)  |
| vigil:stats                 | hash | none                        | fleet counters: duplicate_results,       |
|                             |      |                             | duplicate_deliveries, stale_deliveries   |
| vigil:redis_run_id          | str  | none (one key)              | the Redis run_id of the last complete    |
|                             |      |                             | restart audit (fleet/message_audit.py)   |
| vigil:housekeeping          | hash | none (one key, a field per  | task name -> JSON {at, took, error} of   |
|                             |      | housekeeping task)          | its last run (tasks/housekeeping.py);    |
|                             |      |                             | read by `vigil status`, batch status     |
| vigil:deadlines             | zset | none                        | request id -> deadline_at, non-terminal  |
|                             |      |                             | requests only (create adds, finish drops)|
|                             |      |                             | read by the deadline sweep               |
| vigil:lock:{name}           | str  | the holder's lease (PX)     | beat task locks (two beats never both    |
|                             |      |                             | act); value = holder id                  |
| vigil:job:{name}            | hash | none; a deleted job's is a  | a job (app/fleet/jobs.py): created_at,   |
|                             |      | tombstone for the deadline  | last_active, lease_s, replicas, state    |
| vigil:jobs                  | zset | none                        | job name -> last_active (lease sweep)    |
| vigil:jobreqs:{name}        | set  | none; empty = gone (Redis)  | a job's non-terminal request ids (create |
|                             |      |                             | adds, finish drops): job delete/lease    |
| vigil:poolreqs:{pool}       | set  | none; empty = gone (Redis)  | a pool's non-terminal request ids (create|
|                             |      |                             | adds, finish drops): the pool's pending  |
|                             |      |                             | count for VIGIL_MAX_PENDING_PER_POOL     |
| vigil:pooljobs:{pool}       | set  | none; a job leaves it when  | jobs with their own queue in that pool   |
|                             |      | deleted or abandoned        | (`vigil.pool.{pool}.job.{job}`)          |
| vigil:poolstate:{pool}      | hash | an hour (rewritten or       | why a pool has no worker (reason, at),   |
|                             |      | deleted by every reconcile) | written by the reconcile (app/fleet/     |
|                             |      |                             | reconcile.py), read by `vigil status`    |
| vigil:health:{instance}     | hash | 7 days from its last change;| the worker's health ledger (app/state/   |
|                             |      | dropped with its entry      | health.py): state, streak, failures,     |
|                             |      |                             | last_failure_reason, quarantines, ...;   |
|                             |      |                             | written by the worker, read by beat      |
| vigil:stream:{request_id}   |stream| none while live; result_ttl | the request's token stream (app/state/   |
|                             |      | once terminal (the finish   | streams.py): chunks of generated tokens  |
|                             |      | sets it)                    | the running attempt appends (fenced by   |
|                             |      |                             | the record), an `end` entry at the finish|
| vigil:live:{request_id}     |pubsub| (a channel: nothing stored) | each chunk a `live` request's stream     |
|                             |      |                             | appends, published by the same script    |
|                             |      |                             | (app/state/lua_outputs.py STREAM_APPEND);  |
|                             |      |                             | the online API's readers (app/state/     |
|                             |      |                             | live.py) subscribe                       |
| vigil:call:{call_id}        | hash | the call's deadline plus    | an online API call (app/state/online_    |
|                             |      | result_ttl                  | calls.py): its key, request ids, format  |
| vigil:apikey:{sha256}       | hash | none; deleted when revoked  | an online API key's grant (app/state/    |
|                             |      |                             | api_keys.py): name, job, max_tier        |
| vigil:apikeys               | hash | none                        | every key's sha256 -> name               |

| vigil:file:{file_id}        | hash | VIGIL_BATCH_RETENTION from  | an uploaded batch input file (app/state/ |
|                             |      | upload; a batch extends it  | batches.py): id, bytes, created_at,      |
|                             |      |                             | filename, purpose, lines; or an output   |
|                             |      |                             | file's (batch, kind: output|error)       |
| vigil:filelines:{file_id}   | list | as its file                 | the uploaded file's raw lines, in order  |
| vigil:files                 | zset | none; expired ids pruned on | file id -> created_at (the file list)    |
|                             |      | listing                     |                                          |
| vigil:batch:{batch_id}      | hash | none while live; VIGIL_     | a batch (app/fleet/batches.py): OpenAI's |
|                             |      | BATCH_RETENTION once ended  | Batch fields, job, cursor, counts        |
| vigil:batchin:{batch_id}    | hash | none; deleted at the end    | request id -> {n, c, k}: lines in flight |
| vigil:batchdone:{batch_id}  | hash | as its batch                | line number -> o|e: a line's result is   |
|                             |      |                             | recorded (once: HSETNX)                  |
| vigil:batchout:{batch_id}   | list | as its batch                | the output file's lines (successes)      |
| vigil:batcherr:{batch_id}   | list | as its batch                | the error file's lines                   |
| vigil:batchjob:{job}        | str  | none while its batch lives; | the last batch created under a job name  |
|                             |      | as its batch once ended     | (`vigil batch FILE` finds its batch)     |
| vigil:batches               | zset | none; expired ids pruned on | batch id -> created_at (`batch list`)    |
|                             |      | listing                     |                                          |
| vigil:batches:active        | zset | none; a batch leaves it when| batch id -> created_at: what the batch   |
|                             |      | it ends                     | tick walks                               |

Record fields (vigil:req:*): status (PENDING|RUNNING|SUCCEEDED|FAILED), model, pool, job,
request (validated request JSON), created_at, deadline_at, attempts, dispatch, worker, instance,
started_at, finished_at, result (result JSON), error_kind, error, last_error, history,
pressure_since (when a memory squeeze that keeps refusing its engine start began), streamed
(tokens in the request's stream so far: the next chunk's offset), stream_last (the signature of
the last chunk appended: a chunk sent again is not written twice), begin_token (the running
claim's token: it fences the stream's writes).

history: a JSON list, one entry per attempt begun (oldest first, the newest 32 kept), written by
the Lua scripts in app/state/store.py in the same step as the status change:
    {"attempt": n, "dispatch": d, "worker": "<node name>", "instance": "<instance id, a string>",
     "started_at": t, "ended_at": t | null, "outcome": null | "succeeded" | "failed" | "retry" |
     "requeued", "error": null | "<code>"}
begin appends an open entry (ended_at and outcome null); release closes it "retry", requeue
"requeued" (worker_lost), the winning finish "succeeded" / "failed". Read it with
RequestStore.history.
"""
from __future__ import annotations

PREFIX = "vigil:"
WORKERS = PREFIX + "workers"
STATS = PREFIX + "stats"
DEADLINES = PREFIX + "deadlines"
REDIS_RUN_ID = PREFIX + "redis_run_id"
HOUSEKEEPING_RUNS = PREFIX + "housekeeping"

PENDING = "PENDING"
RUNNING = "RUNNING"
SUCCEEDED = "SUCCEEDED"
FAILED = "FAILED"
TERMINAL = (SUCCEEDED, FAILED)


def request(request_id: str) -> str:
    """The request record hash."""
    return f"{PREFIX}req:{request_id}"


STREAM_PREFIX = PREFIX + "stream:"


def stream(request_id: str) -> str:
    """The request's token stream (a Redis stream; app/state/streams.py)."""
    return STREAM_PREFIX + request_id


LIVE_PREFIX = PREFIX + "live:"
API_KEYS = PREFIX + "apikeys"


def call(call_id: str) -> str:
    """An online API call's record (app/state/online_calls.py)."""
    return f"{PREFIX}call:{call_id}"


def api_key(sha: str) -> str:
    """An online API key's grant, under the key's SHA-256 (app/state/api_keys.py)."""
    return f"{PREFIX}apikey:{sha}"


def live(request_id: str) -> str:
    """The pub/sub channel a `live` request's stream chunks are published on, as they are
    appended (app/state/live.py reads it)."""
    return LIVE_PREFIX + request_id


JOBS = PREFIX + "jobs"


def job(name: str) -> str:
    """A job's hash (app/fleet/jobs.py)."""
    return f"{PREFIX}job:{name}"


def job_requests(name: str) -> str:
    """The set of a job's non-terminal request ids."""
    return f"{PREFIX}jobreqs:{name}"


def pool_requests(pool: str) -> str:
    """The set of a pool's non-terminal request ids (its pending count, for backpressure)."""
    return f"{PREFIX}poolreqs:{pool}"


def pool_jobs(pool: str) -> str:
    """The set of jobs that have their own queue in `pool`."""
    return f"{PREFIX}pooljobs:{pool}"


def pool_state(pool: str) -> str:
    """Why a pool is unserved (hash: reason, at), written by the reconcile."""
    return f"{PREFIX}poolstate:{pool}"


def health(instance_id: int | str) -> str:
    """The health ledger of one worker instance (app/state/health.py)."""
    return f"{PREFIX}health:{instance_id}"


def inflight(instance_id: int | str) -> str:
    """The set of request ids one worker instance is running."""
    return f"{PREFIX}inflight:{instance_id}"


def worker(instance_id: int | str) -> str:
    """One worker instance's registry entry."""
    return f"{PREFIX}worker:{instance_id}"


def lock(name: str) -> str:
    """A beat task's lock."""
    return f"{PREFIX}lock:{name}"


FILES = PREFIX + "files"
BATCHES = PREFIX + "batches"
BATCHES_ACTIVE = PREFIX + "batches:active"


def file(file_id: str) -> str:
    """A batch file's metadata hash (app/state/batches.py)."""
    return f"{PREFIX}file:{file_id}"


def file_lines(file_id: str) -> str:
    """An uploaded batch file's lines (a list)."""
    return f"{PREFIX}filelines:{file_id}"


def batch(batch_id: str) -> str:
    """A batch object's hash (app/fleet/batches.py)."""
    return f"{PREFIX}batch:{batch_id}"


def batch_job(job: str) -> str:
    """The id of the last batch created under a job name (`vigil batch FILE`)."""
    return f"{PREFIX}batchjob:{job}"


def batch_inflight(batch_id: str) -> str:
    """A batch's requests in flight: request id -> the line it runs."""
    return f"{PREFIX}batchin:{batch_id}"


def batch_done(batch_id: str) -> str:
    """A batch's recorded lines: line number -> o (output) or e (error)."""
    return f"{PREFIX}batchdone:{batch_id}"


def batch_output(batch_id: str) -> str:
    """A batch's output file lines (a list)."""
    return f"{PREFIX}batchout:{batch_id}"


def batch_errors(batch_id: str) -> str:
    """A batch's error file lines (a list)."""
    return f"{PREFIX}batcherr:{batch_id}"
