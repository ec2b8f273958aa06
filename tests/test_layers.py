"""Unit tier: the house in floors (docs/architecture.md, "The map"). Every import of app/,
workers/ and tasks/ is read with `ast`; the test fails on an import that goes up a floor, on an
import circle, on a function-level import that is not of a heavy optional package or of the
lazily built Celery app, on Redis calls or a Redis client outside app/state/, and on a worker or
task module that imports the dev harness or the operator tools. The map itself must list every
module once."""
from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "workers", "tasks")

# Floors, lowest first. A module may import its own floor and the floors below it, never above.
FLOORS = [
    # app's ground floor: configuration, the error taxonomy, counters, Celery's control bus.
    ("app.root", lambda m: m.count(".") == 1 and m.startswith("app.") and m != "app.celery_app"),
    ("app.state", lambda m: m.startswith("app.state")),
    ("app.requests", lambda m: m.startswith("app.requests")),
    ("app.fleet", lambda m: m.startswith("app.fleet")),
    # The online API's calls (rendered by vLLM, followed asynchronously): over the request
    # contract and the fleet's ends, under the Celery app (its ports are handed in).
    ("app.online", lambda m: m.startswith("app.online")),
    # The Celery app composes the floors below it and hands them its ports
    # (app/celery_ports.py); the entry points above it (the harness, the operator tools, the
    # worker, the tasks) get it from `shared_app()`.
    ("app.celery_app", lambda m: m in ("app.celery_app", "app")),
    ("app.local", lambda m: m.startswith("app.local")),
    ("app.ops", lambda m: m.startswith("app.ops")),
    ("workers.engine", lambda m: m.startswith("workers.engine")),
    ("workers", lambda m: m.startswith("workers")),
    ("tasks", lambda m: m.startswith("tasks")),
]
# Heavy optional packages may be imported inside the functions that need them (nothing else:
# an import inside a function is otherwise a circle being dodged). xgrammar imports torch;
# outlines_core and jsonschema come with vLLM, not with Vigil (app/requests/structured.py).
LAZY_OK = {"vllm", "torch", "transformers", "peft", "tokenizers", "safetensors", "jinja2",
           "pynvml", "xgrammar", "outlines_core", "jsonschema"}


def floor_of(module: str) -> int:
    for i, (_, match) in enumerate(FLOORS):
        if match(module):
            return i
    raise AssertionError(f"{module} is on no floor")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = modules()


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for every import of a package of ours; a
    `from pkg import name` names the submodule when there is one, and `from app import app` is
    the Celery app ("app:celery")."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for a in child.names:
                    sub = f"{child.module}.{a.name}"
                    if child.module == "app" and a.name in ("app", "celery"):
                        found.append(("app:celery", inner, child.lineno))
                    elif sub in MODULES:
                        found.append((sub, inner, child.lineno))
                    else:
                        found.append((child.module, inner, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return found


def ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES or module == "app:celery"


def test_every_module_is_on_a_floor():
    assert len(MODULES) > 60
    for m in MODULES:
        floor_of(m)


def test_no_module_imports_a_floor_above_its_own():
    upward = []
    for m, path in MODULES.items():
        for target, _, line in imports(path):
            if not ours(target) or target in ("app:celery", "app"):
                continue
            if target.split(".")[0] in PACKAGES and target not in MODULES:
                target = target.rsplit(".", 1)[0]  # a name from a module
            if floor_of(target) > floor_of(m):
                upward.append(f"{path.relative_to(REPO)}:{line} {m} -> {target}")
    assert not upward, "imports that go up a floor:\n" + "\n".join(upward)


def test_app_never_imports_workers_or_tasks_and_engines_import_no_other_worker_module():
    bad = []
    for m, path in MODULES.items():
        for target, _, line in imports(path):
            if m.startswith("app") and target.split(".")[0] in ("workers", "tasks"):
                bad.append(f"{path.relative_to(REPO)}:{line} {target}")
            if (m.startswith("workers.engine") and target.startswith("workers.")
                    and not target.startswith("workers.engine")):
                bad.append(f"{path.relative_to(REPO)}:{line} {target}")
    assert not bad, "\n".join(bad)


def test_workers_and_tasks_never_import_the_dev_harness_or_the_operator_tools():
    """workers/ and tasks/ run in production processes: they import neither app.local (the dev
    harness: a private redis-server, the demo, tiny-llama's adapters) nor app.ops (the operator
    tools). The floors alone would let them (both floors are below workers')."""
    bad = [f"{path.relative_to(REPO)}:{line} {target}" for m, path in MODULES.items()
           if m.split(".")[0] in ("workers", "tasks") for target, _, line in imports(path)
           if target.startswith(("app.local", "app.ops"))]
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_are_only_heavy_packages():
    """No import hides inside a function (the Celery app included: what code below it needs
    of it comes down as its ports, app/celery_ports.py), except heavy optional packages."""
    lazy = []
    for m, path in MODULES.items():
        for target, inner, line in imports(path):
            if not inner or target.split(".")[0] in LAZY_OK:
                continue
            if m == "app" and target == "app.celery_app":  # `from app import app` builds it here
                continue
            lazy.append(f"{path.relative_to(REPO)}:{line} {target}")
    assert not lazy, "imports inside functions:\n" + "\n".join(lazy)


def test_only_the_tasks_look_the_celery_app_up():
    """`from app import app` or `from app import celery` (the lazily built Celery app), or a
    bare `import app` (whose `app.app` builds it), only in tasks/, which declare their tasks on
    it; everything else is handed the app or its ports."""
    found = [f"{path.relative_to(REPO)}:{line} {target}" for m, path in MODULES.items()
             if not m.startswith("tasks") for target, _, line in imports(path)
             if target == "app:celery" or (target == "app" and _bare_import(path, line))]
    assert not found, "the Celery app looked up below tasks/:\n" + "\n".join(found)


def _bare_import(path: Path, line: int) -> bool:
    """Whether line `line` of `path` is `import app` (not `from app import ...`)."""
    return any(isinstance(n, ast.Import) and n.lineno == line and
               any(a.name == "app" for a in n.names) for n in ast.walk(ast.parse(
                   path.read_text())))


BENCH = {".".join(p.relative_to(REPO).with_suffix("").parts): p
         for p in sorted((REPO / "bench").glob("*.py"))}


@pytest.mark.parametrize("where", ["product", "bench"])
def test_no_relative_imports(where):
    """Every import names its module in full (`from app.state import keys`, never `from .
    import keys`): a relative import would slip past every rule of this file."""
    paths = MODULES.values() if where == "product" else BENCH.values()
    bad = [f"{p.relative_to(REPO)}:{n.lineno}" for p in paths
           for n in ast.walk(ast.parse(p.read_text()))
           if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not bad, "relative imports:\n" + "\n".join(bad)


def test_no_module_imports_another_modules_private_names():
    """A name that starts with `_` is its module's own: no module of app/, workers/ or tasks/
    imports one from another (before the one serve, workers/service_many.py imported
    service.py's `_not_run` and `_refused`)."""
    bad = [f"{p.relative_to(REPO)}:{n.lineno} {n.module}.{a.name}" for p in MODULES.values()
           for n in ast.walk(ast.parse(p.read_text()))
           if isinstance(n, ast.ImportFrom) and n.module and ours(n.module)
           for a in n.names if a.name.startswith("_") and a.name != "__version__"]
    assert not bad, "private names imported:\n" + "\n".join(bad)


def test_product_code_never_imports_bench_and_bench_has_no_circle():
    """bench/ measures the product: app/, workers/ and tasks/ never import it, and its own
    modules import each other without a circle."""
    bad = [f"{p.relative_to(REPO)}:{line} {t}" for p in MODULES.values()
           for t, _, line in imports(p) if t.split(".")[0] == "bench"]
    assert not bad, "\n".join(bad)
    graph = {}
    for m, p in BENCH.items():
        deps = set()
        for n in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                     [n.module] + [f"{n.module}.{a.name}" for a in n.names]
                     if isinstance(n, ast.ImportFrom) and n.module else [])
            deps |= {x for x in names if x in BENCH and x != m}
        graph[m] = deps
    assert not _circles(graph), f"import circles in bench/: {_circles(graph)}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_circle():
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for target, _, _ in imports(path):
            if target in MODULES and target != m:
                graph[m].add(target)
            elif target.rsplit(".", 1)[0] in MODULES and target.rsplit(".", 1)[0] != m:
                graph[m].add(target.rsplit(".", 1)[0])
    circles = _circles(graph)
    assert not circles, f"import circles: {circles}"


REDIS_CALLS = {"hget", "hgetall", "hset", "hmget", "zadd", "zrange", "zrangebyscore", "zrem",
               "sadd", "srem", "smembers", "sismember", "scard", "srandmember", "lpush", "rpush",
               "llen", "lrange", "lindex", "delete", "expire", "pipeline", "scan_iter",
               "hscan_iter", "register_script", "zscore", "exists", "info"}


@pytest.mark.parametrize("pkg", ["app", "workers", "tasks"])
def test_only_app_state_calls_the_redis_client(pkg):
    """A Redis command called on a client outside app/state/ (`x.r.hget(...)`,
    `client.llen(...)`): every read and write of Redis goes through app/state/."""
    bad = []
    for m, path in MODULES.items():
        if not m.startswith(pkg) or m.startswith("app.state"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in REDIS_CALLS
                    and isinstance(node.func.value, (ast.Name, ast.Attribute))
                    and _name(node.func.value) in ("r", "client", "redis", "store.raw", "rt.client",
                                                   "self.r", "self.client", "pipe")):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node.func)}")
    assert not bad, "Redis calls outside app/state/:\n" + "\n".join(bad)


def _name(node) -> str:
    return ast.unparse(node)


def client_makers() -> tuple[set[str], set[str]]:
    """What app/state/ has that hands out a Redis client or connection pool (its return
    annotation names a redis-py type): (module-level functions, e.g. conn.connect; methods and
    properties, e.g. RequestStore.raw)."""
    functions, methods = set(), set()
    for m, path in MODULES.items():
        if not m.startswith("app.state"):
            continue
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns
                    and "redis." in ast.unparse(node.returns)):
                (functions if node in top else methods).add(node.name)
    return functions, methods


MAKERS, MAKER_METHODS = client_makers()
# A state object's client (`r`, `_r`, `client`, `_client`) or its outage policy (`_call`).
STATE_INSIDES = {"r", "_r", "client", "_client", "_call"} | MAKER_METHODS


def test_app_states_client_makers_are_found():
    """The rules below know what hands out a client: if these names move, they must follow."""
    assert {"connect", "state_pool"} <= MAKERS and "raw" in MAKER_METHODS


@pytest.mark.parametrize("pkg", ["app", "workers", "tasks"])
def test_only_app_state_reaches_a_stores_client_or_its_outage_policy(pkg):
    """`x.r` or `x.client` (a state object's Redis client, Celery's result backend's),
    `x.raw` (the store's client, for tests and benches) and `x._call` (its outage policy)
    outside app/state/: code there goes through the store's methods and views
    (app/state/views.py), so every read and write rides out an outage the one way
    app/state/calls.py promises."""
    bad = []
    for m, path in MODULES.items():
        if not m.startswith(pkg) or m.startswith("app.state"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in STATE_INSIDES:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "a store's client or outage policy reached from outside app/state/:\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("pkg", ["app", "workers", "tasks"])
def test_only_app_state_holds_a_redis_client(pkg):
    """Outside app/state/, no module imports redis-py (to build a client, `redis.Redis(...)`,
    `from_url`, or to name its types) or calls what app/state/ has that hands out a client
    (`connect`, `state_pool`): it opens a store (`open_store`) and uses what the store hands
    out, so no reader or writer of Redis skips the outage policy (app/state/calls.py). What
    it catches is app/state/calls.py's REDIS_ERRORS. (bench/ and tests/, instruments, may.)"""
    bad = []
    for m, path in MODULES.items():
        if not m.startswith(pkg) or m.startswith("app.state"):
            continue
        tree = ast.parse(path.read_text())
        state_modules = set()  # names bound to an app/state module here (`conn`, `redis_conn`)
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "redis":
                        bad.append(f"{where} import {a.name}")
                    elif a.name.startswith("app.state.") and a.asname:
                        state_modules.add(a.asname)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "redis":
                    bad.append(f"{where} from {node.module} import ...")
                elif node.module.startswith("app.state"):
                    for a in node.names:
                        if a.name in MAKERS:
                            bad.append(f"{where} from {node.module} import {a.name}")
                        elif f"{node.module}.{a.name}" in MODULES:
                            state_modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in MAKERS
                    and (isinstance(node.value, ast.Name) and node.value.id in state_modules
                         or ast.unparse(node.value).startswith("app.state."))):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "a Redis client made or held outside app/state/:\n" + "\n".join(bad)


def map_entries() -> list[str]:
    """The paths docs/architecture.md's map lists ("## The map": a tree of folders and files,
    two spaces a level, descriptions in a column of their own)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## The map", 1)[1].split("```", 2)[1]
    folders: list[str] = []
    out = []
    for line in block.splitlines():
        m = re.match(r"^( *)([a-z0-9_]+(?:\.py|/))(?:\s|$)", line)
        if not m or len(m.group(1)) % 2 or len(m.group(1)) > 2 * len(folders):
            continue  # a description's own line, in the description column
        level = len(m.group(1)) // 2
        del folders[level:]
        if m.group(2).endswith("/"):
            folders.append(m.group(2))
        else:
            out.append("".join(folders) + m.group(2))
    return out


def test_the_map_lists_every_module_once():
    """docs/architecture.md's map names every .py of app/, workers/ and tasks/ (but the
    packages' __init__.py) exactly once, and nothing that is not there: a module added, moved
    or removed without the map fails here."""
    listed = Counter(map_entries())
    on_disk = {str(p.relative_to(REPO)) for p in MODULES.values() if p.name != "__init__.py"}
    assert len(listed) > 60
    missing = sorted(on_disk - set(listed))
    gone = sorted(set(listed) - on_disk)
    twice = sorted(p for p, n in listed.items() if n > 1)
    assert not (missing or gone or twice), (f"not in the map: {missing}; in the map but not on "
                                            f"disk: {gone}; listed more than once: {twice}")
