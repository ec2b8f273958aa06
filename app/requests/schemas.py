"""The wire contract of `vigil.generate`: what a request may say and what a result holds.

Validation is strict (no silent `"5"` -> 5 coercion, no unknown fields): a producer's mistake is
reported at submit time, before anything is published. The worker validates again, because a
message can bypass the producer (`send_task`, raw queue pushes).
"""
from __future__ import annotations

import math
import re
import reprlib
from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      field_validator, model_validator)

from app.errors import INVALID_REQUEST, UNSUPPORTED_VERSION, RequestError
from app.requests.structured import Structured

# The newest version this code writes. A request is stamped with the lowest version that holds
# it (`needed_version`): one that uses no field of version 2 is a version 1 message, which a
# worker from before version 2 still serves during a rolling upgrade; one that uses no field of
# version 3 is at most version 2, which a worker from before version 3 still serves.
SCHEMA_VERSION = 3
# Versions this code can read. A message naming any other is refused (`unsupported_version`),
# never read as the nearest known one; a message without the field is version 1. A worker hands
# a message of a newer version back instead (workers/service.py): a newer worker serves it.
SUPPORTED_VERSIONS = frozenset({1, 2, 3})
JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_STOP_SEQUENCES = 16
MAX_DEADLINE_S = 7 * 86400.0
# vLLM 0.32's bounds: top logprobs per token (its default max_logprobs), named token ids
# (MAX_LOGPROB_TOKEN_IDS), bad words (VLLM_MAX_NUM_BAD_WORDS), temperature.
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128
MAX_BAD_WORDS = 128
MAX_TEMPERATURE = 2.0
# Vigil's own bounds on lists a message carries (the vocabulary bounds the ids further).
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORD_CHARS = 256
# Below this temperature vLLM samples greedily (its _SAMPLING_EPS): n > 1 needs more.
GREEDY_BELOW = 1e-5
# The fields of version 2, with their defaults (a field at its default is not sent).
V2_DEFAULTS = {
    "n": 1, "logprobs": None, "prompt_logprobs": None, "logprob_token_ids": None, "top_k": 0,
    "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_tokens": 0, "stop_token_ids": None, "logit_bias": None,
    "include_stop_str_in_output": False, "skip_special_tokens": True, "bad_words": None,
    "allowed_token_ids": None, "structured": None, "detokenize": True,
    "priority": "default",  # its tier (app/requests/tiers.py)
}
# The fields of version 3, with their defaults. A worker from before version 3 hands such a
# message back (it never fails it): the online API sets `live` only where every live worker of
# the pool reads version 3 (app/requests/version_gate.py `pool_reads`).
V3_DEFAULTS = {"live": False}
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]


class GenerateRequest(BaseModel):
    """One generation request, as validated at submit time and again in the worker."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str = Field(min_length=1, max_length=128)
    prompt: str | None = Field(None, min_length=1)
    prompt_token_ids: list[StrictInt] | None = Field(None, min_length=1)
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    ignore_eos: StrictBool = False
    # A LoRA adapter of the base model: a registered name or a path under an adapter root
    # (app/requests/adapters.py).
    lora: str | None = Field(None, min_length=1, max_length=4096)
    job: str = Field("default", pattern=JOB_PATTERN)
    # Its tier (app/requests/tiers.py): interactive work is taken ahead of default and bulk.
    priority: Literal["interactive", "default", "bulk"] = "default"
    deadline_s: float | None = Field(None, gt=0.0, le=MAX_DEADLINE_S)
    # -- version 2: the rest of vLLM's generation contract (docs/api.md, "Request fields") ----
    # Samples of the prompt, run as one engine request (vLLM's parallel sampling); at most
    # VIGIL_MAX_N (app/requests/limits.py).
    n: StrictInt = Field(1, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logprob_token_ids: list[TokenId] | None = Field(None, min_length=1,
                                                    max_length=MAX_LOGPROB_TOKEN_IDS)
    top_k: StrictInt = Field(0, ge=-1, lt=2**31)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # Token id (a decimal string, as JSON keys are; an int is taken too) -> bias added to its
    # logit, -100 to 100 (vLLM clamps to that range; OpenAI's bounds).
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    bad_words: list[str] | None = Field(None, min_length=1, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1,
                                                    max_length=MAX_ALLOWED_TOKEN_IDS)
    structured: Structured | None = None
    # False: token ids only (no text, no decoded tokens in logprobs): the engine skips its
    # incremental detokenizer, the front end's largest per-token cost.
    detokenize: StrictBool = True
    # -- version 3 -------------------------------------------------------------------------
    # A reader shows the tokens as they come (the online API's streams): the worker reads the
    # request's new tokens after every engine step and writes each step's as a chunk of its
    # stream at once, and the stream's append also publishes it to live readers
    # (docs/api.md, "Live streams"), instead of a chunk per VIGIL_STREAM_FLUSH_MS.
    live: StrictBool = False
    # The lowest version that holds the request when not given (`needed_version`).
    schema_version: Literal[1, 2, 3] = 1

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v):
        if v is not None and any(not s for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v):
        # A Python caller's int keys become the decimal strings JSON makes of them, so the
        # request compares equal before and after the wire (idempotent resubmit).
        if isinstance(v, dict):
            if len(v) > MAX_LOGIT_BIAS:
                raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
            out = {}
            for k, b in v.items():
                if type(k) is int and 0 <= k < 2**31:
                    k = str(k)
                if not isinstance(k, str) or not re.fullmatch(r"0|[1-9][0-9]{0,9}", k) \
                        or int(k) >= 2**31:
                    raise ValueError("keys must be token ids (non-negative integers, or their "
                                     "decimal strings)")
                out[k] = b
            return out
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v):
        if v is not None and any(not math.isfinite(b) or not -100.0 <= b <= 100.0
                                 for b in v.values()):
            raise ValueError("biases must be finite numbers from -100 to 100")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v):
        if v is not None and any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in v):
            raise ValueError(f"bad words must be non-blank strings of at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
        return v

    @field_validator("prompt", "stop", "lora", "bad_words")
    @classmethod
    def _encodable(cls, v):
        # A lone surrogate is not Unicode text: the tokenizer, Redis and the filesystem all need
        # UTF-8, so it would fail later and less clearly (or be retried as an engine error).
        for text in [v] if isinstance(v, str) else v or ():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode text (it holds a lone surrogate, which "
                                 "has no UTF-8 form)") from None
        return v

    @field_validator("temperature", "top_p", "deadline_s", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("prompt_token_ids")
    @classmethod
    def _non_negative_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _exactly_one_prompt(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        return self

    @model_validator(mode="after")
    def _consistent(self):
        # vLLM's own cross-field rules (SamplingParams._verify_args, _validate_logprobs), here
        # so they fail at submit instead of on the first attempt.
        if self.n > 1 and self.temperature < GREEDY_BELOW:
            raise ValueError("n > 1 needs temperature > 0 (greedy samples would all be the same; "
                             "vLLM refuses them)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        if self.logprob_token_ids is not None and self.logprobs is not None \
                and self.logprobs != len(self.logprob_token_ids):
            raise ValueError("with logprob_token_ids, logprobs must be left out or equal their "
                             "number (vLLM returns the named ids instead of the top ones)")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize (they are matched in the text)")
        return self

    @model_validator(mode="after")
    def _version(self):
        needed = needed_version(self)
        if "schema_version" not in self.model_fields_set:
            object.__setattr__(self, "schema_version", needed)  # frozen: set once, here
        elif self.schema_version < needed:
            used = ", ".join(fields_of_version(self, needed))
            raise ValueError(f"version {needed} fields ({used}) need schema_version {needed} "
                             "(leave schema_version out: the lowest version that holds the "
                             "request is used)")
        return self

    @property
    def pool(self) -> str:
        """The pool (model) that serves this request."""
        return self.model

    def prompt_bytes(self) -> int:
        """Size of the prompt on the wire, for the submit-time byte limit."""
        if self.prompt is not None:
            return len(self.prompt.encode("utf-8", "surrogatepass"))
        return 8 * len(self.prompt_token_ids or ())


class GenerateResult(BaseModel):
    """What `r.get()` returns for a successful request."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    attempts: int
    worker: str
    lora: str | None = None
    resumed_at: list[int] | None = None
    # Only when asked for (logprobs / logprob_token_ids; prompt_logprobs); entries as docs/api.md
    # ("Results") shows them.
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict | None] | None = None
    # n > 1: every sample (index, text, token_ids, finish_reason, completion_tokens, logprobs,
    # cumulative_logprob, resumed_at); the fields above are sample 0's.
    choices: list[dict] | None = None


def v2_fields_used(req: GenerateRequest) -> list[str]:
    """The version 2 fields `req` sets to something other than their default."""
    return fields_of_version(req, 2)


def fields_of_version(req: GenerateRequest, version: int) -> list[str]:
    """The fields of schema version `version` (2 or 3) that `req` sets to something other
    than their default."""
    defaults = V2_DEFAULTS if version == 2 else V3_DEFAULTS if version == 3 else {}
    return [k for k, d in defaults.items() if getattr(req, k) != d]


def needed_version(req: GenerateRequest) -> int:
    """The lowest schema version that holds `req`: 3 when it uses a version 3 field, else 2
    when it uses a version 2 field, else 1."""
    if fields_of_version(req, 3):
        return 3
    return 2 if v2_fields_used(req) else 1


def newer_version(kwargs: object) -> int | None:
    """The message's schema_version when it is an int newer than any this code reads (a newer
    producer sent it: the worker hands it back for a newer worker), else None."""
    v = kwargs.get("schema_version") if isinstance(kwargs, dict) else None
    return v if type(v) is int and v > max(SUPPORTED_VERSIONS) else None


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e.get("loc", ())) or "request"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see docs/api.md)"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def check_version(kwargs: dict) -> None:
    """Refuse a request whose `schema_version` is not one this code knows: RequestError
    (unsupported_version) naming it. Absent means version 1; a bool or a string is not a version."""
    version = kwargs.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        known = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        try:
            shown = reprlib.repr(version)  # bounded: the value may be anything a sender wrote
        except ValueError:  # an int too long to print
            shown = f"<{type(version).__name__}>"
        raise RequestError.of(UNSUPPORTED_VERSION, f"schema_version {shown} is "
                              f"not one this Vigil knows ({known}); upgrade the worker, or send "
                              "a version it knows")


def parse_request(kwargs: object) -> GenerateRequest:
    """Validate raw kwargs into a GenerateRequest; RequestError(invalid_request) says what to fix,
    RequestError(unsupported_version) when the request's schema_version is unknown here."""
    if not isinstance(kwargs, dict):
        raise RequestError.of(INVALID_REQUEST, f"kwargs must be a mapping, got {type(kwargs).__name__}")
    check_version(kwargs)
    try:
        return GenerateRequest.model_validate(kwargs)
    except ValidationError as err:
        raise RequestError.of(INVALID_REQUEST, _describe(err)) from None
    except (TypeError, ValueError, RecursionError) as err:
        raise RequestError.of(INVALID_REQUEST, f"unreadable request: {err}") from None
