"""The wire contract of `vigil.generate`: what a request may say and what a result holds.

Validation is strict (no silent `"5"` -> 5 coercion, no unknown fields): a producer's mistake is
reported at submit time, before anything is published. The worker validates again, because a
message can bypass the producer (`send_task`, raw queue pushes).
"""
from __future__ import annotations

import math
import reprlib
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      field_validator, model_validator)

from app.errors import INVALID_REQUEST, UNSUPPORTED_VERSION, RequestError

SCHEMA_VERSION = 1
# Versions this code can read. A message naming any other is refused (`unsupported_version`),
# never read as the nearest known one; a message without the field is version 1.
SUPPORTED_VERSIONS = frozenset({1})
JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_STOP_SEQUENCES = 16
MAX_DEADLINE_S = 7 * 86400.0


class GenerateRequest(BaseModel):
    """One generation request, as validated at submit time and again in the worker."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str = Field(min_length=1, max_length=128)
    prompt: str | None = Field(None, min_length=1)
    prompt_token_ids: list[StrictInt] | None = Field(None, min_length=1)
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
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
    schema_version: Literal[1] = SCHEMA_VERSION

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

    @field_validator("prompt", "stop", "lora")
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

    @field_validator("temperature", "top_p", "deadline_s")
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
