"""The configuration reference, docs/configuration.md, generated from the settings object.

    python -m app.ops.config_doc > docs/configuration.md

Every field of `VigilSettings` (app/settings.py) becomes one row: its `VIGIL_*` variable, type,
default, bounds (the field's ge/gt/le/lt), and a description made of the field's `description`
and the comment above the `DEFAULT_*` constant it defaults to (app/settings_defaults.py). The
derived values are the settings' properties, described by their docstrings. tests/test_config_doc.py fails when the
file is out of date, or when a field has neither a description nor a commented constant.
"""
from __future__ import annotations

import ast
import inspect
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import SecretStr
from pydantic.types import PathType
from pydantic_core import PydanticUndefined
from pydantic_settings import NoDecode

from app import settings_defaults as defaults_module
from app.settings import SECRET_FIELDS, VigilSettings
from app.settings_derived import DerivedSettings
from app.settings_defaults import ENV_PREFIX

COMMAND = "python -m app.ops.config_doc > docs/configuration.md"

HEADER = f"""# Configuration reference

<!-- Generated from app/settings.py by `{COMMAND}`; do not edit by hand.
     tests/test_config_doc.py fails when this file is out of date. -->

Every Vigil process (producer, worker, beat, Flower, the `vigil` command) reads one typed
settings object, `VigilSettings` in app/settings.py, from environment variables: field `x` is
`VIGIL_X`. A bad value stops the process at start with `SettingsError`, naming the variable
(docs/operations.md, Settings, says where it shows). Producers, workers, beat and Flower must
agree on the Redis settings (`VIGIL_REDIS_*`) and on `VIGIL_MODELS_FILE`.

Secrets (marked *secret*) are never printed: their repr is masked and a settings error says
`(got (hidden))`; `VIGIL_REDIS_URL` is only ever shown without its user and password.
Durations are in seconds. Booleans accept `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`.
Lists are comma-separated.
"""


def _module_comments() -> dict[str, str]:
    """Constant name -> the comment block directly above its assignment in
    app/settings_defaults.py."""
    source = inspect.getsource(defaults_module)
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            comment = _comment_above(lines, node.lineno)
            if comment:
                out[node.targets[0].id] = comment
    return out


def _comment_above(lines: list[str], lineno: int) -> str:
    """The block of `#` lines directly above 1-based line `lineno`, as one sentence."""
    block = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        block.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(block)


def _class_fields() -> tuple[dict[str, str], dict[str, str]]:
    """Field name -> the module constant its Field(...) default names, and field name -> the
    comment block directly above the field in the class body."""
    source = inspect.getsource(VigilSettings)
    lines = source.splitlines()
    constants, comments = {}, {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            value = node.value
            if isinstance(value, ast.Call) and value.args:
                value = value.args[0]
            if isinstance(value, ast.Name) and value.id.isupper():
                constants[node.target.id] = value.id
            comment = _comment_above(lines, node.lineno)
            if comment:
                comments[node.target.id] = comment
    return constants, comments


def _is_seconds(constant: str | None, annotation) -> bool:
    return bool(constant and constant.endswith("_S")) and annotation in (int, float)


def _type(field, constant: str | None) -> str:
    ann = field.annotation
    optional = False
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(args) < len(typing.get_args(ann))
        ann = args[0]
    name = None
    if typing.get_origin(ann) is typing.Annotated:
        base, *meta = typing.get_args(ann)
        if any(isinstance(m, PathType) and m.path_type == "file" for m in meta):
            name = "path of an existing file"
        ann = base
    if name is None:
        if NoDecode in field.metadata or typing.get_origin(ann) is list:
            name = "list"
        elif typing.get_origin(ann) is typing.Literal:
            name = "one of " + ", ".join(str(a) for a in typing.get_args(ann))
        elif ann is SecretStr:
            name = "string, *secret*"
        elif _is_seconds(constant, ann):
            name = "seconds"
        else:
            name = {bool: "bool", int: "int", float: "float", str: "string",
                    Path: "path"}.get(ann, getattr(ann, "__name__", str(ann)))
    return name + (", optional" if optional else "")


def _default(field) -> str:
    if field.default_factory is not None:
        if field.default_factory is list:
            return "empty"
        doc = inspect.getdoc(field.default_factory)
        return doc.splitlines()[0] if doc else "computed"
    d = field.default
    if d is PydanticUndefined:
        return "required"
    if d is None:
        return "unset"
    if isinstance(d, SecretStr):
        return "empty" if not d.get_secret_value() else "(hidden)"
    if isinstance(d, bool):
        return "true" if d else "false"
    if isinstance(d, float) and d.is_integer():
        d = int(d)
    if d == "":
        return "empty"
    return f"`{d}`"


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for cls, attr, sym in ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"),
                               (annotated_types.Le, "le", "<="), (annotated_types.Lt, "lt", "<")):
            if isinstance(m, cls):
                v = getattr(m, attr)
                parts.append(f"{sym} {int(v) if isinstance(v, float) and v.is_integer() else v}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def field_rows() -> list[dict[str, str]]:
    """One dict per settings field, in declaration order: variable, type, default, bounds,
    description: the field's description and the comment of its DEFAULT_* constant, else the
    comment above the field; empty when it has none of them."""
    comments = _module_comments()
    constants, field_comments = _class_fields()
    rows = []
    for name, field in VigilSettings.model_fields.items():
        constant = constants.get(name)
        text = " ".join(t for t in (field.description or "",
                                    comments.get(constant, "") if constant else "") if t)
        text = text or field_comments.get(name, "")
        if name in SECRET_FIELDS and "*secret*" not in _type(field, constant):
            text += " (secret)"
        rows.append({"variable": f"`{ENV_PREFIX}{name.upper()}`",
                     "type": _type(field, constant),
                     "default": _default(field), "bounds": _bounds(field),
                     "description": text})
    return rows


def derived_rows() -> list[tuple[str, str]]:
    """(property, docstring) of every derived value of the settings (its properties, most on
    DerivedSettings)."""
    out = []
    for name, member in sorted((vars(DerivedSettings) | vars(VigilSettings)).items()):
        if isinstance(member, property) and not name.startswith("_") and member.__doc__:
            out.append((name, " ".join(inspect.getdoc(member).split())))
    return out


def render() -> str:
    """The whole of docs/configuration.md."""
    lines = [HEADER, "## Variables", "",
             "| variable | type | default | bounds | description |",
             "| --- | --- | --- | --- | --- |"]
    for r in field_rows():
        lines.append("| " + " | ".join(_cell(r[k]) for k in
                                         ("variable", "type", "default", "bounds",
                                          "description")) + " |")
    lines += ["", "Rules across variables (e.g. `VIGIL_RETRY_BACKOFF_MAX` >= "
              "`VIGIL_RETRY_BACKOFF`, the TLS files only with `rediss://`) are checked at start "
              "too; their messages name the variable to change.", "", "## Derived values", "",
              "Computed from the variables above, not set directly.", "",
              "| value | meaning |", "| --- | --- |"]
    for name, doc in derived_rows():
        lines.append(f"| `{name}` | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Print the reference to stdout."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
