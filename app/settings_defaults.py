"""Every default and bound of Vigil's settings (app/settings.py), each a named constant with
the reason it has that value."""

ENV_PREFIX = "VIGIL_"

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# Three attempts: one transient blip and one retry on another worker still end in a result,
# while a request that keeps failing does not burn GPU time forever.
DEFAULT_MAX_ATTEMPTS = 3
# An hour: long enough for a queue backlog on a small fleet, short enough that nobody waits a day.
DEFAULT_REQUEST_DEADLINE_S = 3600.0
# The longest one generation may run inside a running engine before Vigil gives up on that attempt
# (a wedge: the engine made no progress for it). Time spent waiting for an engine to load, switch
# models or recover does not count (that is VIGIL_ENGINE_START_TIMEOUT's). The threads pool
# ignores Celery's time limits, so Vigil enforces this itself.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# The longest an engine start may take (a load, a model switch's load, the restart inside a
# quarantine) before the worker gives up on it; at least twice the model's last start on this
# worker. On a GPU a large model loads for minutes; on 2 cores tiny-llama takes 18-27 s.
DEFAULT_ENGINE_START_TIMEOUT_S = 900.0
# A prompt larger than this is refused at submit time: it protects Redis and the wire, not the
# model (the model's own context limit is checked separately).
DEFAULT_MAX_PROMPT_BYTES = 256 * 1024
DEFAULT_MAX_TOKENS_CAP = 32768
# Samples of one prompt a request may ask for (`n`): enough for a GRPO group; each sample is a
# sequence in the engine's batch, so a large n takes the batch from other requests.
DEFAULT_MAX_N = 16
# vLLM 0.32's own ceiling on `n` (VLLM_MAX_N_SEQUENCES).
VLLM_MAX_N = 16384
# The logprob entries one result may hold: n x max_tokens x (1 + top logprobs per token), plus
# the prompt's tokens x (1 + prompt_logprobs); one entry is ~60 bytes of JSON, so 2**20 entries
# (20 alternatives of 48k tokens) is ~60 MB in Redis at most, twice (the record and Celery's
# result).
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 20
# A warm engine holds GiBs; free it after a minute with nothing to do.
DEFAULT_IDLE_CLEANUP_S = 60.0
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
# A worker silent this long is dead: its in-flight requests are requeued elsewhere. Far below
# the visibility timeout (2,220 s with Vigil's defaults; kombu's own default is 1 h), which is all
# Celery alone would offer for a dead threads-pool worker.
DEFAULT_WORKER_REAP_TIMEOUT_S = 120.0
MIN_WORKER_REAP_TIMEOUT_S = 30.0
# A worker that registered but never became ready (Celery's worker_ready, then its preload done
# or failed) is judged by this window instead: an hour covers the slowest warm-up (weights
# pulled from a network disk, a heartbeat thread starved by the load), during which a false
# reap would hand its requests to others while it still holds them.
DEFAULT_WORKER_REGISTRATION_GRACE_S = 3600.0
# How often beat fails requests past their deadline: a request ends at most this late.
DEFAULT_DEADLINE_SWEEP_S = 30.0
# Terminal records (and Celery results) are kept a day for late pollers and duplicate deliveries.
DEFAULT_RESULT_TTL_S = 86400
MIN_RESULT_TTL_S = 60
# Batch objects (app/fleet/batches.py). A batch's file may hold OpenAI's limits: 50,000 requests
# and 200 MB; each line is kept in Redis while its batch lives (docs/batch.md, Limits).
DEFAULT_BATCH_MAX_REQUESTS = 50_000
DEFAULT_BATCH_MAX_BYTES = 200 * 1024 * 1024
# How often beat advances the live batches: a batch's results are recorded at most this late.
DEFAULT_BATCH_TICK_S = 2.0
# The most requests of one batch in flight at once (the rest wait in Redis as lines, not as
# requests, so other jobs' requests are not stuck behind 50,000 of them in the pool's queues).
DEFAULT_BATCH_WINDOW = 512
# An ended batch, its results and its input file are kept this long (OpenAI keeps files until
# deleted; a week bounds what Redis holds).
DEFAULT_BATCH_RETENTION_S = 7 * 86400
# Tasks in flight per worker: enough threads to keep the engine's batch (max_num_seqs) full.
# `vigil worker` raises it to the largest max_num_seqs of the pools it serves on its platform
# (app/requests/engine_defaults.py), so a GPU worker's engine can run its batch full.
DEFAULT_WORKER_CONCURRENCY = 128
# GPU memory kept free beside vLLM's budget on each card: EngineCore creates its CUDA context
# (and, on a tensor-parallel worker, NCCL's buffers) before vLLM checks that its budget
# (gpu_memory_utilization x total) is free, so a start sized to what NVML showed free must leave
# that much aside. Not measured here (no GPU on the development machines); the figure is above
# what others measured: a bare torch CUDA context at 667 MB with eager module loading and 287 MB
# lazy (pytorch/pytorch#86509; lazy is the default since CUDA 12.2), 781 MB at a torch process
# start with its libraries (pytorch/pytorch#34323), and cuBLAS' workspaces add tens of MiB.
# tests/test_gpu_devices.py holds the plan against a 900 MiB context; bench/gpu_check.py
# measures the context (and two tensor-parallel ranks' NCCL) on a GPU host and fails when it
# exceeds this setting. Was 512 MiB, about a bare context, which made a sized-down start fail
# vLLM's own check on every retry. Tensor-parallel workers may need more (NCCL's buffers).
DEFAULT_GPU_HEADROOM_MIB = 1024
# Threads of `vigil housekeeper`: beat's five tasks each run alone under their lock, so a few
# threads let a slow reconcile (it asks workers for their queues) never hold up a sweep or a reap.
DEFAULT_HOUSEKEEPER_CONCURRENCY = 4
DEFAULT_RETRY_BACKOFF_S = 2.0
DEFAULT_RETRY_BACKOFF_MAX_S = 60.0
# The same engine death this many times in a row, with no generation completed between (request
# or canary), means the worker or its device is broken: it hands its requests back and exits.
# Three: a poison request costs one death at a time (a canary passes between), and an external
# kill is one; three in a row with nothing working between is the engine itself.
DEFAULT_ENGINE_DEATH_LIMIT = 3
# Health ledger (app/state/health.py): failures proven by traffic (timed-out requests, a stalled engine)
# within the window, with no completed generation since, that quarantine a worker. Three: one
# slow request is a blip, three in a row is a wedge.
DEFAULT_FAILURE_THRESHOLD = 3
# A failure counts this long. Long enough that a trickle of one timeout per request timeout still
# adds up (stretched to threshold x request_timeout if shorter), short enough that blips days
# apart never do.
DEFAULT_HEALTH_WINDOW_S = 3600.0
# Token streams (app/state/streams.py): a worker's flush interval and the chunk size that calls
# an early flush. Chosen by measurement (docs/performance.md, "Token streams").
DEFAULT_STREAM_FLUSH_MS = 1000
# The engine's waves (workers/engine/waves.py): runs that arrive while others are in the engine
# enter in waves at most this far apart. Chosen by measurement (docs/performance.md, "Where a
# short request's time goes" and "The eighth pass"): 25 and 60 ms both took generate_many's
# short workload from ~400 to 620-720 req/s; once the worker's loop became the limit, 50 and
# 100 ms made its rounds 6-8% shorter than 25 ms (0: 15% longer). Once a wave no longer went
# when the engine emptied but after its window or a full step ("The ninth pass"), 100 ms beat
# 50 for .delay (0.23 against 0.19 of the bare engine, one run each; its engine steps held
# 21-23 runs against 10-11), generate_many within its spread, and 200 ms added nothing. A short
# request of a tier that is not interactive, arriving while the engine is busy, waits up to
# this long to enter it.
DEFAULT_ENGINE_WAVE_MS = 100
DEFAULT_STREAM_CHUNK_TOKENS = 64
# Requests in flight and no engine step for this long: the engine is stalled (SIGSTOPped,
# deadlocked). Far above one engine step (milliseconds to seconds); at most half the request
# timeout is used.
DEFAULT_STALL_TIMEOUT_S = 120.0
# Failed canaries in a row before a quarantined worker gives up and leaves (exit 70).
DEFAULT_MAX_CANARY_FAILURES = 5
# Task threads of a worker kept free of bulk work: the bulk tier may hold at
# most concurrency - this many requests at once (app/state/intake.py), so an
# interactive request arriving at a worker full of bulk work starts at once. Default-tier
# requests may use every thread (a fleet that names no tiers loses nothing).
DEFAULT_INTERACTIVE_SLOTS = 8
# Bulk work's floor: with a backlog in every tier, lower tiers still get at least this share of
# a worker's intake (every 1/floor-th pop takes the lowest tier first); 0: strict priority.
DEFAULT_BULK_FLOOR = 0.1
# A bulk request yields its batch seat to a waiting interactive request at most this many
# times (each resumes from its stream, losing nothing); past it, it is never picked again.
DEFAULT_MAX_PREEMPTIONS = 3
# A request handed back by a stopping worker (SIGTERM: a scale-in, a deploy) gives its attempt
# back at most this many times (each resumes from its stream, losing nothing); past it such a
# hand-back uses the attempt, as a dead worker's does.
DEFAULT_MAX_DRAINS = 3
# `generate_many` publishes at most this many requests per Celery message: one message's intake,
# Celery request and ack for all of them; a request that needs a retry goes back on its own.
DEFAULT_REQUESTS_PER_MESSAGE = 32
# How long a request waits for memory when no engine can start for memory pressure (a co-tenant
# holding the card), from the squeeze's first refusal: five minutes outlast a co-tenant's batch
# job step, while a card that stays full fails the request well before its deadline.
DEFAULT_MEMORY_PRESSURE_WINDOW_S = 300.0
# How often beat checks that quarantined workers really stopped consuming.
DEFAULT_HEALTH_TICK_S = 30.0
# How often beat's reconcile makes every worker of a pool consume all of the pool's job queues.
DEFAULT_RECONCILE_S = 30.0
# How often beat looks for vigil.generate messages on other Celery apps' default queues (a
# producer that sent without `queue=`) and moves them to vigil.housekeeping to be forwarded.
DEFAULT_FOREIGN_QUEUE_SCAN_S = 2.0
# How often beat looks for open requests whose message is nowhere (no queue, worker or unacked
# entry): a producer that died between writing the record and publishing leaves one.
DEFAULT_MESSAGE_AUDIT_S = 60.0
# Pools the reconcile gives a worker per pass: each costs an engine start somewhere; a burst of
# new pools is spread over passes instead of stopping every worker at once.
DEFAULT_RECONCILE_CONCURRENCY = 4
# Submit must not hang on an unreachable Redis: fail within a few seconds with a clear error.
DEFAULT_REDIS_TIMEOUT_S = 5.0
# How long a worker keeps retrying a request's Redis writes (begin, result, retry) and its
# publishes while Redis is unreachable (a restart, a failover), holding what it generated,
# before it gives the request up to the sweeps.
DEFAULT_REDIS_OUTAGE_GRACE_S = 120.0
# Prometheus scrapes workers from another host; the metrics hold no prompts or outputs.
DEFAULT_METRICS_ADDRESS = "0.0.0.0"
# Backpressure: past this many open (not yet ended) requests in one job, or in one pool, `.delay`
# raises `overloaded` at once instead of letting Redis grow without bound. Far above any real
# backlog (a record is ~1 KiB: a million is ~1 GiB of Redis), so they bite only a runaway
# producer; 0 = unlimited.
DEFAULT_MAX_PENDING_PER_JOB = 100_000
DEFAULT_MAX_PENDING_PER_POOL = 1_000_000

# The online API (app/ops/api_online.py): a body is bounded before anything of it is read or
# stored. 8 MiB holds the largest prompt a request may carry (VIGIL_MAX_PROMPT_BYTES, 256 KiB)
# many times over, as a list of prompts or a long chat.
DEFAULT_API_MAX_BODY_BYTES = 8 * 1024 * 1024
