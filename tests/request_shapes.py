"""Shared by the request-field tests (tests/test_generation_fields.py,
tests/test_generation_fields_vllm.py): a minimal request, the refusal a request gets at
submit, and JSON schemas of a given depth or width."""
from __future__ import annotations

import pytest

from app.errors import RequestError
from app.requests.admit import admit
from app.requests.models import get_registry
from app.settings import load_settings

OK = {"model": "tiny-llama", "prompt": "hello"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"]}


def refusal(kwargs, **overrides) -> str:
    with pytest.raises(RequestError) as ei:
        admit(kwargs, load_settings(**overrides), get_registry())
    return str(ei.value)


def deep_schema(depth: int) -> dict:
    """A JSON schema of objects nested `depth` deep through `properties` (each level is two
    levels of JSON nesting: the properties object and the schema inside it)."""
    node: dict = {"type": "string"}
    for i in range(depth):
        node = {"type": "object", "properties": {f"k{i % 7}": node}, "required": [f"k{i % 7}"]}
    return node


def json_deep(depth: int) -> dict:
    """Plain objects nested `depth` deep ({"a": {"a": ...}}, a schema of unknown keywords)."""
    node: dict = {}
    for _ in range(depth):
        node = {"a": node}
    return node


def wide_schema(width: int) -> dict:
    """A flat object schema with `width` properties (~35 bytes of JSON each: the 64 KiB
    bound falls near 1,900)."""
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer", "minimum": i}
                                             for i in range(width)}}
