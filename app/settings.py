"""Vigil's one typed settings object, read from `VIGIL_*` environment variables.

Every default is a named constant with the reason it has that value (app/settings_defaults.py). `load_settings()` turns a
pydantic ValidationError into a `SettingsError` whose message names the environment variable, so
a bad deployment fails at start with a line an operator can act on.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.drills import parse_drill
from app.redis_url import check_url, is_sentinel, is_tls, redacted_url
from app.settings_derived import DerivedSettings
from app.settings_defaults import (DEFAULT_API_MAX_BODY_BYTES, DEFAULT_BATCH_MAX_BYTES, DEFAULT_BATCH_MAX_REQUESTS,
                                    DEFAULT_BATCH_RETENTION_S, DEFAULT_BATCH_TICK_S,
                                    DEFAULT_BATCH_WINDOW, DEFAULT_BULK_FLOOR,
                                    DEFAULT_DEADLINE_SWEEP_S, DEFAULT_ENGINE_DEATH_LIMIT,
                                    DEFAULT_ENGINE_START_TIMEOUT_S, DEFAULT_FAILURE_THRESHOLD,
                                    DEFAULT_FOREIGN_QUEUE_SCAN_S, DEFAULT_GPU_HEADROOM_MIB,
                                    DEFAULT_HEALTH_TICK_S, DEFAULT_HEALTH_WINDOW_S,
                                    DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HOUSEKEEPER_CONCURRENCY,
                                    DEFAULT_IDLE_CLEANUP_S, DEFAULT_INTERACTIVE_SLOTS,
                                    DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_CANARY_FAILURES,
                                    DEFAULT_MAX_LOGPROB_ENTRIES, DEFAULT_MAX_N,
                                    DEFAULT_MAX_PENDING_PER_JOB, DEFAULT_MAX_PENDING_PER_POOL,
                                    DEFAULT_MAX_DRAINS, DEFAULT_MAX_PREEMPTIONS,
                                    DEFAULT_MAX_PROMPT_BYTES,
                                    DEFAULT_MAX_TOKENS_CAP, DEFAULT_MEMORY_PRESSURE_WINDOW_S,
                                    DEFAULT_MESSAGE_AUDIT_S, DEFAULT_METRICS_ADDRESS,
                                    DEFAULT_RECONCILE_CONCURRENCY, DEFAULT_RECONCILE_S,
                                    DEFAULT_REDIS_OUTAGE_GRACE_S, DEFAULT_REDIS_TIMEOUT_S,
                                    DEFAULT_REDIS_URL, DEFAULT_REQUESTS_PER_MESSAGE,
                                    DEFAULT_REQUEST_DEADLINE_S, DEFAULT_REQUEST_TIMEOUT_S,
                                    DEFAULT_RESULT_TTL_S, DEFAULT_RETRY_BACKOFF_MAX_S,
                                    DEFAULT_RETRY_BACKOFF_S, DEFAULT_STALL_TIMEOUT_S,
                                    DEFAULT_STREAM_CHUNK_TOKENS, DEFAULT_STREAM_FLUSH_MS,
                                    DEFAULT_ENGINE_WAVE_MS,
                                    DEFAULT_WORKER_CONCURRENCY, DEFAULT_WORKER_REAP_TIMEOUT_S,
                                    DEFAULT_WORKER_REGISTRATION_GRACE_S, ENV_PREFIX,
                                    MIN_RESULT_TTL_S, MIN_WORKER_REAP_TIMEOUT_S, VLLM_MAX_N)


def _default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/vigil`, else `~/.cache/vigil`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vigil"


class SettingsError(Exception):
    """A setting is invalid; the message names the environment variable and what to change."""


class VigilSettings(DerivedSettings, BaseSettings):
    """All of Vigil's configuration. Field `x` is read from env var `VIGIL_X`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # repr=False: the URL may hold a password, and a settings object can end up in a log line.
    redis_url: str = Field(DEFAULT_REDIS_URL, repr=False, description="Broker, result backend "
                           "and state: redis://, rediss:// (TLS), sentinel://host:port;... "
                           "(Sentinel) or unix:// (app/state/conn.py). Its credentials are "
                           "never shown.")
    # TLS and Sentinel (docs/operations.md, "Redis beyond one box"): app/state/conn.py hands
    # them to the broker, the result backend and the state client alike.
    redis_tls_ca_file: FilePath | None = Field(None, description="CA certificates (PEM) that "
                                               "Redis' certificate is checked against "
                                               "(rediss:// only; default: the system's).")
    redis_tls_cert_file: FilePath | None = Field(None, description="Client certificate (PEM) "
                                                 "for a Redis that requires one (rediss:// "
                                                 "only).")
    redis_tls_key_file: FilePath | None = Field(None, description="Key of the client "
                                                "certificate (rediss:// only).")
    redis_sentinel_master: str = Field("", description="Name of the master the sentinels "
                                       "watch; required with a sentinel:// URL.")
    redis_sentinel_password: SecretStr = Field(SecretStr(""), description="The sentinels' own "
                                               "password, if they have one (the master's "
                                               "goes in the URL).")
    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1, le=20)
    request_deadline: float = Field(DEFAULT_REQUEST_DEADLINE_S, gt=0)
    request_timeout: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    engine_start_timeout: float = Field(DEFAULT_ENGINE_START_TIMEOUT_S, gt=0)
    max_prompt_bytes: int = Field(DEFAULT_MAX_PROMPT_BYTES, ge=1)
    max_tokens_cap: int = Field(DEFAULT_MAX_TOKENS_CAP, ge=1, description="Upper bound on a "
                                "request's max_tokens, besides the model's max_model_len.")
    max_n: int = Field(DEFAULT_MAX_N, ge=1, le=VLLM_MAX_N, description="Upper bound on a "
                       "request's n (samples of one prompt).")
    max_logprob_entries: int = Field(DEFAULT_MAX_LOGPROB_ENTRIES, ge=1, description="Upper "
                                     "bound on the logprob entries one result may hold "
                                     "(docs/api.md, Results).")
    max_pending_per_job: int = Field(DEFAULT_MAX_PENDING_PER_JOB, ge=0, description="Open "
                                     "requests one job may have before submits fail "
                                     "`overloaded`.")
    max_pending_per_pool: int = Field(DEFAULT_MAX_PENDING_PER_POOL, ge=0, description="Open "
                                      "requests one pool may have before submits fail "
                                      "`overloaded`; 0 = unlimited.")
    idle_cleanup: float = Field(DEFAULT_IDLE_CLEANUP_S, ge=0, description="0 keeps engines warm forever.")
    heartbeat_interval: float = Field(DEFAULT_HEARTBEAT_INTERVAL_S, gt=0, description="How "
                                      "often a worker rewrites its registry entry.")
    deadline_sweep_interval: float = Field(DEFAULT_DEADLINE_SWEEP_S, gt=0)
    worker_reap_timeout: float = Field(DEFAULT_WORKER_REAP_TIMEOUT_S, ge=0,
                                       description="0 disables the reaper.")
    worker_registration_grace: float = Field(DEFAULT_WORKER_REGISTRATION_GRACE_S, ge=0,
                                             description="Reap window of a worker that never "
                                             "became ready; >= worker_reap_timeout.")
    # Test-only: lets a test shorten the reap timeout below the production floor. Never set it
    # in a deployment: a timeout near the heartbeat interval reaps live workers.
    allow_short_reap_timeout: bool = False
    result_ttl: int = Field(DEFAULT_RESULT_TTL_S, ge=1)
    stream_flush_ms: int = Field(DEFAULT_STREAM_FLUSH_MS, ge=0, le=60000, description="A "
                                 "worker writes the tokens its requests generated to their "
                                 "token streams at least this often (one round trip for all "
                                 "of them); 0 turns token streams, and resuming from them, off.")
    engine_wave_ms: int = Field(DEFAULT_ENGINE_WAVE_MS, ge=0, le=1000, description="A "
                                  "worker's engine takes the short runs (at most 16 tokens a "
                                  "sample) that arrive while others are in it in waves at "
                                  "most this far apart, or as soon as a wave fills one "
                                  "engine step, each wave into one step "
                                  "(workers/engine/waves.py); a run that finds the engine "
                                  "idle enters at once. 0: every run at once.")
    stream_chunk_tokens: int = Field(DEFAULT_STREAM_CHUNK_TOKENS, ge=1, le=65536,
                                     description="A request with this many tokens not yet "
                                     "written to its stream is written at the next flush "
                                     "without waiting for stream_flush_ms.")
    # Test-only: lets a test wait for finished records to really expire. Never set it in a
    # deployment: a result gone before a slow poller reads it is a lost result.
    allow_short_result_ttl: bool = False
    worker_concurrency: int = Field(DEFAULT_WORKER_CONCURRENCY, ge=1, le=4096)
    gpu_headroom_mib: int = Field(DEFAULT_GPU_HEADROOM_MIB, ge=0, le=65536)
    retry_backoff: float = Field(DEFAULT_RETRY_BACKOFF_S, ge=0, description="Base of the retry "
                                 "backoff: full jitter, uniform in [0, min(max, base * "
                                 "2^(attempt-1))].")
    retry_backoff_max: float = Field(DEFAULT_RETRY_BACKOFF_MAX_S, ge=0, description="Cap of "
                                     "the retry backoff; >= retry_backoff.")
    redis_timeout: float = Field(DEFAULT_REDIS_TIMEOUT_S, gt=0)
    redis_outage_grace: float = Field(DEFAULT_REDIS_OUTAGE_GRACE_S, ge=0,
                                      description="0: fail at once.")
    engine_death_limit: int = Field(DEFAULT_ENGINE_DEATH_LIMIT, ge=1, le=100)
    failure_threshold: int = Field(DEFAULT_FAILURE_THRESHOLD, ge=1, le=1000)
    health_window: float = Field(DEFAULT_HEALTH_WINDOW_S, gt=0)
    stall_timeout: float = Field(DEFAULT_STALL_TIMEOUT_S, ge=0, description="0 disables the "
                                 "engine-progress watchdog.")
    max_canary_failures: int = Field(DEFAULT_MAX_CANARY_FAILURES, ge=1, le=100)
    interactive_slots: int = Field(DEFAULT_INTERACTIVE_SLOTS, ge=0, le=4096, description="A "
                                   "worker's task threads kept free of bulk requests, for "
                                   "interactive and default ones (0: none kept).")
    requests_per_message: int = Field(DEFAULT_REQUESTS_PER_MESSAGE, ge=1, le=1024,
                                      description="The most requests `generate_many` puts in "
                                      "one Celery message.")
    max_preemptions: int = Field(DEFAULT_MAX_PREEMPTIONS, ge=0, le=100, description="How often "
                                 "one bulk request may yield its batch seat to an "
                                 "interactive one (0: never preempt).")
    max_drains: int = Field(DEFAULT_MAX_DRAINS, ge=0, le=100, description="How often one "
                            "request may be handed back by a stopping worker (SIGTERM) without "
                            "using an attempt (0: every such hand-back uses one).")
    bulk_floor: float = Field(DEFAULT_BULK_FLOOR, ge=0.0, le=1.0, description="The least share "
                              "of a worker's intake that lower tiers get while interactive "
                              "requests wait too (0: strict priority).")
    memory_pressure_window: float = Field(DEFAULT_MEMORY_PRESSURE_WINDOW_S, gt=0)
    health_tick_interval: float = Field(DEFAULT_HEALTH_TICK_S, gt=0)
    job_lease: float | None = Field(None, gt=0, description="A job with no submit or poll for "
                                    "this long is abandoned (default: request_deadline).")
    reconcile_interval: float = Field(DEFAULT_RECONCILE_S, gt=0)
    message_audit_interval: float = Field(DEFAULT_MESSAGE_AUDIT_S, gt=0, description="How "
                                          "often beat publishes again the open requests whose "
                                          "message is nowhere (a producer that died between "
                                          "record and publish).")
    foreign_queues: str = Field("celery", description="Comma-separated queues of other Celery "
                                "apps (Celery's default queue, `celery`, where a producer that "
                                "sends vigil.generate without `queue=` lands) that beat scans "
                                "for vigil.generate messages to forward; every other message "
                                "there is left in place. Empty: no scan.")
    foreign_queue_scan_interval: float = Field(DEFAULT_FOREIGN_QUEUE_SCAN_S, gt=0,
                                               description="How often beat scans "
                                               "foreign_queues.")
    reconcile_concurrency: int = Field(DEFAULT_RECONCILE_CONCURRENCY, ge=1, le=1000)
    preload: bool = Field(True, description="Load the first pool's engine at worker start.")
    cache_dir: Path = Field(default_factory=_default_cache_dir, description="Built models "
                            "(models/tiny-llama-v1) and the vLLM logging config.")
    models_file: Path | None = Field(None, description="JSON file with extra model registry entries.")
    adapter_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Directories LoRA adapters may be named from by path "
        "(comma-separated).")
    pools: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Models a worker loads at start (comma-separated)."
    )
    task_events: bool = Field(False, description="Celery task events from start (Flower turns "
                              "them on while it runs).")
    log_level: str = Field("INFO", description="Level of vLLM's log lines and the default of "
                           "`vigil worker --loglevel` (DEBUG, INFO, WARNING, ERROR, CRITICAL).")
    # Prompts and outputs are user data: never logged unless an operator asks for it.
    log_payloads: bool = False
    log_requests: bool = Field(False, description="Celery's two INFO lines per request "
                               "(received, succeeded) in worker logs. Off: at hundreds of "
                               "requests/s they cost a fifth of a worker's throughput "
                               "(docs/performance.md); failures and retries are logged either "
                               "way.")
    # Flower's basic auth (`vigil flower`, app/ops/cli.py). Flower shows every worker and task and can
    # shut workers down, so `vigil flower` refuses to start without both unless auth is disabled
    # explicitly. The password is a SecretStr: its repr and any settings error hide the value.
    flower_user: str = Field("", description="Flower's basic-auth user.")
    flower_password: SecretStr = Field(SecretStr(""), description="Flower's basic-auth password.")
    flower_auth_disabled: bool = Field(False, description="Let `vigil flower` run without auth "
                                       "(local use only: it then listens on 127.0.0.1).")
    # Batch objects and `vigil api` (app/fleet/batches.py, app/ops/api.py; docs/batch.md).
    batch_max_requests: int = Field(DEFAULT_BATCH_MAX_REQUESTS, ge=1, le=1_000_000,
                                    description="Most request lines a batch file may hold.")
    batch_max_bytes: int = Field(DEFAULT_BATCH_MAX_BYTES, ge=1024, le=512 * 1024 * 1024,
                                 description="Largest batch input file, in bytes.")
    batch_tick_interval: float = Field(DEFAULT_BATCH_TICK_S, gt=0, description="How often beat "
                                       "advances the live batches (submit, collect, end).")
    batch_window: int = Field(DEFAULT_BATCH_WINDOW, ge=1, le=100_000, description="Most "
                              "requests of one batch in flight at once.")
    batch_retention: float = Field(DEFAULT_BATCH_RETENTION_S, ge=60, description="How long an "
                                   "ended batch, its results and files are kept.")
    # `vigil api`: the OpenAI Files and Batches endpoints, behind a bearer token (as Flower, it
    # refuses to start without one unless auth is disabled, and then listens on 127.0.0.1).
    api_token: SecretStr = Field(SecretStr(""), description="The bearer token `vigil api` "
                                 "requires.")
    api_auth_disabled: bool = Field(False, description="Let `vigil api` run without a token "
                                    "(local use only: it then listens on 127.0.0.1).")
    api_max_body_bytes: int = Field(DEFAULT_API_MAX_BODY_BYTES, ge=1024, le=256 * 1024 * 1024,
                                    description="Largest body of an online API call "
                                    "(/v1/completions, /v1/chat/completions, /tokenize), "
                                    "refused from its Content-Length before it is read.")
    # What a `celery worker` process of this app is: a worker serving pools (an engine), or the
    # housekeeper (beat's tasks only, no engine, no registry entry). `vigil housekeeper` sets it.
    role: Literal["worker", "housekeeper"] = Field(
        "worker", description="Set by `vigil housekeeper`: this Celery worker runs beat's "
        "tasks only and never loads an engine.")
    housekeeper_concurrency: int = Field(DEFAULT_HOUSEKEEPER_CONCURRENCY, ge=1, le=64)
    # Which engine a worker runs. Anything but vllm is for benchmarks and drills only (the worker
    # logs it loudly at start): instant answers without a model (bench/throughput.py); drill is
    # vLLM plus the faults of VIGIL_DRILL (app/drills.py).
    engine: Literal["vllm", "instant", "drill"] = Field(
        "vllm", description="The engine a worker runs: vllm, instant (no model: overhead "
        "benchmarks) or drill (vLLM plus the faults of VIGIL_DRILL).")
    drill: str = Field("", description="The faults a drill engine injects, comma-separated: "
                       "poison=<marker>, die_on_start, slow_start=<seconds>, slow_step=<seconds>, "
                       "black_hole (app/drills.py).")
    # The witness (workers/engine/witness.py): each worker appends every generation its engine
    # finished to <dir>/<pid>.jsonl, for checks that must not trust Vigil's own records.
    witness_dir: Path | None = Field(None, description="Where workers write down every finished "
                                     "generation (tests and the soak; off by default).")
    # Prometheus metrics (app/metrics.py). Off by default: every worker process serves its own
    # endpoint, so workers sharing a host need a port each (set it per worker line).
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of this worker's /metrics; "
                              "0 serves none.")
    metrics_address: str = Field(DEFAULT_METRICS_ADDRESS, description="Address /metrics listens "
                                 "on.")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        return check_url(v)

    @field_validator("models_file", "redis_tls_ca_file", "redis_tls_cert_file",
                     "redis_tls_key_file", "witness_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        return None if v == "" else v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return v

    @field_validator("drill")
    @classmethod
    def _drill(cls, v: str) -> str:
        parse_drill(v)  # ValueError names the bad fault
        return v

    @field_validator("flower_user")
    @classmethod
    def _flower_user(cls, v: str) -> str:
        # Flower reads its credentials as a comma-separated list of user:password pairs.
        if ":" in v or "," in v:
            raise ValueError("must not contain ':' or ','")
        return v

    @field_validator("flower_password")
    @classmethod
    def _flower_password(cls, v: SecretStr) -> SecretStr:
        if "," in v.get_secret_value():  # Flower would split it into two credentials
            raise ValueError("must not contain ','")
        return v

    @field_validator("pools", "adapter_roots", mode="before")
    @classmethod
    def _split_pools(cls, v):
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @model_validator(mode="after")
    def _redis_shape(self):
        # Each message starts with the field it is about: _explain names its variable.
        url = self.redis_url
        if is_sentinel(url) and not self.redis_sentinel_master:
            raise ValueError("redis_sentinel_master must be set with a sentinel:// "
                             "VIGIL_REDIS_URL")
        if self.redis_sentinel_master and not is_sentinel(url):
            raise ValueError("redis_sentinel_master is set but VIGIL_REDIS_URL is not "
                             "sentinel://")
        for f in ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file"):
            # Set but unused would mean plain text where the operator asked for TLS.
            if getattr(self, f) is not None and not is_tls(url):
                raise ValueError(f"{f} applies to a rediss:// VIGIL_REDIS_URL only (TLS "
                                 "through Sentinel is not supported)")
        if self.redis_tls_key_file is not None and self.redis_tls_cert_file is None:
            raise ValueError("redis_tls_key_file needs redis_tls_cert_file")
        return self

    @model_validator(mode="after")
    def _backoff_order(self):
        if self.retry_backoff_max < self.retry_backoff:
            raise ValueError("retry_backoff_max must be >= retry_backoff")
        return self

    @model_validator(mode="after")
    def _reap_after_heartbeats(self):
        t = self.worker_reap_timeout
        if t > 0 and not self.allow_short_reap_timeout:
            floor = max(MIN_WORKER_REAP_TIMEOUT_S, 3 * self.heartbeat_interval)
            if t < floor:
                raise ValueError(f"worker_reap_timeout must be 0 (off) or >= {floor:g} s "
                                 "(30 s and 3 heartbeat intervals)")
        return self

    @model_validator(mode="after")
    def _grace_after_timeout(self):
        # A never-ready worker gets at least as long as a ready one: a grace below the timeout
        # would reap a warming-up worker sooner than a serving one.
        t = self.worker_reap_timeout
        if t > 0 and self.worker_registration_grace < t:
            raise ValueError(f"worker_registration_grace must be >= worker_reap_timeout ({t:g} s)")
        return self

    @model_validator(mode="after")
    def _result_ttl_floor(self):
        if self.result_ttl < MIN_RESULT_TTL_S and not self.allow_short_result_ttl:
            raise ValueError(f"result_ttl must be >= {MIN_RESULT_TTL_S} s (late pollers and "
                             "duplicate deliveries read finished records)")
        return self


# Settings whose value an error message must never show.
SECRET_FIELDS = frozenset({"flower_password", "redis_sentinel_password", "api_token"})
# Settings whose value is shown with its credentials removed.
URL_FIELDS = frozenset({"redis_url"})


_DEFAULT = object()  # a cross-field rule's field that was not given


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = str(e["loc"][0]) if e.get("loc") else ""
        given = e.get("input")
        if not field:  # a cross-field rule: name the field its message starts with
            field = str(e.get("msg", "")).removeprefix("Value error, ").split(" ")[0]
            # Its input is every setting given (secrets included): show that field's only.
            given = given.get(field, _DEFAULT) if isinstance(given, dict) else _DEFAULT
        var = ENV_PREFIX + field.upper()
        got = ("(hidden)" if field in SECRET_FIELDS else "its default" if given is _DEFAULT
               else repr(redacted_url(given)) if field in URL_FIELDS and isinstance(given, str)
               else repr(given))
        lines.append(f"{var}: {e['msg']} (got {got})")
    return "invalid settings: " + "; ".join(lines)


def load_settings(**overrides) -> VigilSettings:
    """Read and validate settings from the environment (plus explicit overrides).

    Raises SettingsError naming each bad `VIGIL_*` variable.
    """
    try:
        return VigilSettings(**overrides)
    except ValidationError as err:
        raise SettingsError(_explain(err)) from None


@functools.lru_cache(maxsize=1)
def get_settings() -> VigilSettings:
    """The process-wide settings, read once (tests call `get_settings.cache_clear()`)."""
    return load_settings()
