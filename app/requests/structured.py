"""Structured outputs: what a request's `structured` field may say, and the checks made before
anything is published (docs/api.md, "Structured outputs").

`Structured` is one of vLLM's `StructuredOutputsParams` constraints: a JSON schema, any JSON
object, a regular expression, a choice among strings, or an EBNF/Lark grammar. Its shape is
checked by the schema (app/requests/schemas.py), in the producer and again in the worker. At
submit, `check_compiles` also asks the model's structured-output backend library to compile it
when that library is installed in the producer (xgrammar, vLLM's default; outlines_core), so an
uncompilable schema is `invalid_request` before publish instead of on the first attempt. The
engine's own front end checks again (vLLM's validation): a constraint it refuses fails the
request `invalid_request` at once, the engine untouched.

After the engine, `violation` checks a complete output against its constraint, with parsers that
are not the backend that held the engine to it (a strict JSON parse and `jsonschema`, Python's
`re`, membership): a backend's bug (xgrammar 0.2.8 lets a raw control character into a string
with maxLength) must not reach the caller as a silently invalid result (workers/result.py).
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.errors import INVALID_REQUEST, RequestError

log = logging.getLogger("vigil.structured")

# A constraint's JSON size, at most: a schema or grammar is compiled on the engine's loop
# thread (vLLM's front end), so its size bounds how long it can hold the engine's batch.
MAX_STRUCTURED_BYTES = 64 * 1024
# vLLM 0.32's own bound on a JSON schema's nesting (MAX_STRUCTURED_OUTPUT_JSON_NESTING).
MAX_JSON_NESTING = 64
MAX_CHOICES = 1024
# The backend a model uses when its registry entry names none (vLLM's "auto" tries xgrammar
# first and falls back to others).
DEFAULT_BACKEND = "auto"


class Structured(BaseModel):
    """Exactly one constraint: `json` (a JSON schema, an object), `json_object` (true: any JSON
    object), `regex`, `choice` (a list of strings) or `grammar` (EBNF, or Lark)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json")
    json_object: Literal[True] | None = None
    regex: str | None = Field(None, min_length=1, max_length=MAX_STRUCTURED_BYTES)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1, max_length=MAX_STRUCTURED_BYTES)

    @field_validator("regex", "grammar")
    @classmethod
    def _text(cls, v):
        if v is not None:
            if not v.strip():
                raise ValueError("must not be blank")
            if "\x00" in v:
                raise ValueError("must not hold a NUL character")
            _utf8(v)
        return v

    @field_validator("choice")
    @classmethod
    def _choices(cls, v):
        if v is not None:
            for c in v:
                if not c:
                    raise ValueError("choices must be non-empty strings")
                _utf8(c)
        return v

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v):
        if v is not None:
            if nesting(v) > MAX_JSON_NESTING:
                raise ValueError(f"the JSON schema nests objects and arrays deeper than "
                                 f"{MAX_JSON_NESTING} levels (vLLM's bound)")
            size = _json_size(v)  # before the metaschema, whose cost grows with the schema
            if size > MAX_STRUCTURED_BYTES:
                raise ValueError(f"the JSON schema is {size} bytes of JSON; the limit is "
                                 f"{MAX_STRUCTURED_BYTES}")
            check_json_schema(v)
        return v

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_schema", "json_object", "regex", "choice", "grammar")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        size = _json_size(self.wire())
        if size > MAX_STRUCTURED_BYTES:
            raise ValueError(f"the constraint is {size} bytes of JSON; the limit is "
                             f"{MAX_STRUCTURED_BYTES}")
        return self

    def wire(self) -> dict:
        """The constraint as sent on the wire: {"json": {...}} | {"regex": "..."} | ..."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(iter(self.wire()))


def _json_size(value) -> int:
    """Bytes of `value` as UTF-8 JSON."""
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None


def nesting(value: Any, limit: int = MAX_JSON_NESTING) -> int:
    """How many levels of objects and arrays `value` has, the outermost counted (`{}` is 1,
    `{"a": []}` is 2), as vLLM 0.32 counts them (`_exceeds_json_nesting`): counted level by
    level, never recursively, and never past `limit` + 1."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level and depth <= limit:
        depth += 1
        level = [c for node in level
                 for c in (node.values() if isinstance(node, dict) else node)
                 if isinstance(c, (dict, list))]
    return depth


def check_json_schema(schema: dict) -> None:
    """ValueError when `schema` is not a valid JSON schema by its own metaschema (Draft 2020-12
    unless it names another), checked with `jsonschema` when it is installed."""
    try:
        import jsonschema
    except ImportError:  # a producer without it: the engine's backend checks the schema
        return
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the schema"
        raise ValueError(f"not a valid JSON schema at {where}: {e.message}"[:400]) from None
    except (RecursionError, TypeError, ValueError) as e:
        raise ValueError(f"not a valid JSON schema: {e}"[:400]) from None


def backend_of(engine_args: dict) -> str:
    """The structured-output backend an engine with these registry engine args uses."""
    cfg = engine_args.get("structured_outputs_config") or {}
    return str(cfg.get("backend", DEFAULT_BACKEND)) if isinstance(cfg, dict) else DEFAULT_BACKEND


def check_compiles(s: Structured, backend: str, model: str) -> None:
    """RequestError(invalid_request) naming the reason when the model's backend cannot compile
    `s`: xgrammar (vLLM's default, also tried first by "auto") or outlines, compiled with their
    own library when it is installed here; other backends are left to the engine's front end.
    With "auto", a constraint xgrammar refuses is left to the engine too (vLLM falls back to
    another backend)."""
    why = ""
    if backend in ("xgrammar", "auto"):
        why = _xgrammar_refusal(s)
        if why and backend == "auto":
            return
    elif backend == "outlines":
        why = _outlines_refusal(s)
    if why:
        raise RequestError.of(INVALID_REQUEST, f"structured ({s.kind}) cannot be compiled by "
                              f"{model}'s structured-output backend ({backend}): {why}"[:600])


def _xgrammar_refusal(s: Structured) -> str:
    """xgrammar's reason for refusing `s`, or "" when it compiles or xgrammar gives no verdict:
    only its own errors (RuntimeError, ValueError) refuse. Anything else is no verdict on the
    constraint (in a worker, `xgrammar` still being imported by the engine's thread is a
    partially initialized module with no `Grammar` yet): the engine's own check decides."""
    try:
        import xgrammar as xgr
    except ImportError:
        return ""
    try:
        if s.json_schema is not None:
            xgr.Grammar.from_json_schema(json.dumps(s.json_schema))
        elif s.regex is not None:
            xgr.Grammar.from_regex(s.regex)
        elif s.grammar is not None:
            # vLLM's own test (grammar_is_likely_lark): a grammar with a `::=` rule is EBNF.
            lark = not any("::=" in re.sub(r"(#|//).*$", "", line)
                           for line in s.grammar.split("\n"))
            (xgr.Grammar.from_lark if lark else xgr.Grammar.from_ebnf)(s.grammar)
    except (RuntimeError, ValueError) as e:  # xgrammar's own errors are plain RuntimeErrors
        return " ".join(str(e).split()) or type(e).__name__
    except Exception as e:
        log.warning("xgrammar gave no verdict on a %s constraint (%s: %s); the engine checks it",
                    s.kind, type(e).__name__, e)
    return ""


def violation(s: Structured, text: str) -> str:
    """Why `text`, a complete output (the engine ended it, not `max_tokens` or a stop
    sequence), breaks `s`, or "" when it holds to it or cannot be checked here. Checked apart
    from the backend that held the engine to it: `json` and `json_object` by a strict JSON parse
    (no raw control character in a string, no NaN or Infinity) and `json` then by its schema
    (`jsonschema`, installed with vLLM; formats are not checked, a schema it cannot use is
    not); `regex` by Python's `re.fullmatch`, `.` matching any character as the backends' does
    (a pattern Python cannot compile is not checked); `choice` by membership. A `grammar` is not
    checked: no parser of EBNF or Lark but the backend's own. The reason names positions, never
    the output's text (user data)."""
    if s.choice is not None:
        return "" if text in s.choice else \
            f"{len(text)} characters, none of its {len(s.choice)} choices"
    if s.regex is not None:
        try:
            pattern = re.compile(s.regex, re.DOTALL)
        except (re.error, RecursionError, OverflowError):
            return ""
        return "" if pattern.fullmatch(text) else \
            f"{len(text)} characters that its regex does not match whole"
    if s.json_schema is None and s.json_object is None:
        return ""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError as e:
        return f"not strict JSON: {e}"
    except RecursionError:
        return ""
    if s.json_object is not None:
        return "" if isinstance(value, dict) else \
            f"JSON, but not an object (a {type(value).__name__})"
    return _schema_violation(s.json_schema, value)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _schema_violation(schema: dict, value: Any) -> str:
    try:
        import jsonschema
    except ImportError:  # not installed here: the strict parse alone
        return ""
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        err = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    except Exception:  # a schema jsonschema cannot use (an unresolvable $ref): not checked
        return ""
    if err is None:
        return ""
    where = "/".join(str(p) for p in err.absolute_path) or "the top"
    # The keyword and its value are the schema's; the instance (user data) is left out.
    return (f"JSON its schema refuses at {where}: {err.validator} "
            f"{err.validator_value!r}")[:400]


def _outlines_refusal(s: Structured) -> str:
    if s.json_object is not None or s.grammar is not None:
        return f"vLLM's outlines backend does not support {s.kind}"
    try:
        from outlines_core import json_schema as oc_json
    except ImportError:
        return ""
    if s.json_schema is not None:
        try:
            oc_json.build_regex_from_schema(json.dumps(s.json_schema))
        except Exception as e:
            return " ".join(str(e).split()) or type(e).__name__
    return ""


