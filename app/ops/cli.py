"""The `vigil` command: worker, status, model, flower, demo, batch, api.

    vigil worker --gpu 0                 # pinned to GPU 0, named gpu0@%h
    vigil worker --gpu 0-3               # one tensor-parallel engine on 4 GPUs, gpu0-3@%h
    vigil worker --cpu --name cpu1@%h    # no GPU; several workers may share a host
    vigil housekeeper                    # beat's tasks on their own threads, no engine
    vigil status [--wide|--json] [--watch S]  # workers (health state, streak) and pools
    vigil job create|list|delete NAME    # jobs (app/fleet/jobs.py)
    vigil model build-tiny DIR           # build tiny-llama (random weights, local tokenizer)
    vigil flower --port 5555             # Flower behind basic auth (VIGIL_FLOWER_USER/_PASSWORD)
    vigil demo [--keep]                  # the end-to-end demo (make demo); --keep: stay up
    vigil batch FILE.jsonl [--job NAME]  # an OpenAI Batch input file (docs/batch.md)
    vigil batch submit FILE.jsonl        # a batch object the fleet runs; then status ID
                                         # [--watch], list, cancel ID, results ID
    vigil api --port 8000 [--workers N]  # OpenAI online API, Files, Batches (VIGIL_API_TOKEN)
    vigil api-key create NAME [--job J] [--max-tier T] | list | revoke ID|NAME
    vigil request ID [--json]            # one request: status, attempts, and why it waits
    vigil request ID --follow            # its text as it is generated, until it ends
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from app.celery_app import shared_app
from app.devices import GpuSpecError, parse_gpu_spec
from app.errors import VigilError
from app.fleet import jobs
from app.fleet.cancel import ENDED_NOW, cancel_requests
from app.local.demo import run_demo
from app.requests.model_files import build_tiny_llama
from app.ops import batch_cli, metrics_exporter
from app.ops.api import DEFAULT_API_PORT, ApiAuthMissing, listen_address, serve
from app.requests.batch_file import valid_job
from app.ops.batch_run import run_command
from app.ops.request_view import follow_request, run_request
from app.ops.status import run_status
from app.ops.worker_start import run_housekeeper, run_worker
from app.requests.models import get_registry
from app.settings import SettingsError, get_settings
from app.state.store import open_store

# `vigil metrics`' port: beside the workers' (VIGIL_METRICS_PORT) and Flower's 5555.
DEFAULT_METRICS_EXPORTER_PORT = 9108


DEFAULT_FLOWER_PORT = 5555  # Flower's own default
FLOWER_LOCAL_ADDRESS = "127.0.0.1"  # where Flower listens when it runs without auth


class FlowerAuthMissing(Exception):
    """`vigil flower` has no credentials and auth was not disabled: it must not start."""


def flower_command(args: argparse.Namespace, settings) -> tuple[list[str], dict[str, str]]:
    """The `celery flower` command line and the environment it adds, for `vigil flower` (pure).

    The credentials go to Flower in its FLOWER_BASIC_AUTH variable, never on the command line,
    which any user of the host can read (`ps`). Without both VIGIL_FLOWER_USER and
    VIGIL_FLOWER_PASSWORD it raises FlowerAuthMissing, unless VIGIL_FLOWER_AUTH_DISABLED is set
    and neither is: then Flower runs without auth and listens on 127.0.0.1 unless `--address`
    says otherwise.
    """
    user, password = settings.flower_user, settings.flower_password.get_secret_value()
    argv = [sys.executable, "-m", "celery", "-A", "app", "flower", f"--port={args.port}"]
    env: dict[str, str] = {}
    address = args.address
    if user and password:
        env["FLOWER_BASIC_AUTH"] = f"{user}:{password}"
    elif settings.flower_auth_disabled and not (user or password):
        address = address or FLOWER_LOCAL_ADDRESS
    else:
        missing = " and ".join(v for v, val in (("VIGIL_FLOWER_USER", user),
                                                ("VIGIL_FLOWER_PASSWORD", password)) if not val)
        raise FlowerAuthMissing(
            f"refusing to start Flower without basic auth: set {missing} (or, for local use "
            "only, VIGIL_FLOWER_AUTH_DISABLED=1 with neither set; Flower then listens on "
            f"{FLOWER_LOCAL_ADDRESS})")
    if address:
        argv.append(f"--address={address}")
    return argv, env


def _cmd_metrics(args: argparse.Namespace) -> int:
    s = get_settings()
    try:
        metrics_exporter.serve(open_store(s), get_registry(), s,
                               args.port, args.address)
    except KeyboardInterrupt:
        return 0
    return 0


def _cmd_flower(args: argparse.Namespace) -> int:
    try:
        argv, extra_env = flower_command(args, get_settings())
    except FlowerAuthMissing as e:
        print(f"vigil flower: {e}", file=sys.stderr)
        return 2
    if "FLOWER_BASIC_AUTH" not in extra_env:
        print("vigil flower: basic auth is disabled (VIGIL_FLOWER_AUTH_DISABLED); for local use "
              "only", file=sys.stderr)
    # Flower replaces this process: signals reach it directly (honcho, compose, systemd).
    os.execve(argv[0], argv, {**os.environ, **extra_env})
    return 0  # pragma: no cover


def _cmd_status(args: argparse.Namespace) -> int:
    return run_status(as_json=args.json, watch=args.watch, wide=args.wide)


def _cmd_job(args: argparse.Namespace) -> int:
    store = open_store(get_settings())
    try:
        if args.job_cmd == "create":
            store.jobs.create(args.name, replicas=args.replicas, lease_s=args.lease)
            print(f"job {args.name} ready")
        elif args.job_cmd == "list":
            rows = store.jobs.list()
            if args.json:
                print(json.dumps(rows))
            else:
                for r in rows:
                    print(f"{r['name']:<32} pending {r['pending']:>7}  replicas {r['replicas']}"
                          f"  last active {time.time() - r['last_active']:.0f} s ago")
        else:
            n = jobs.delete_job(store, shared_app().vigil_ports, args.name,
                                f"job {args.name!r} was deleted")
            if n < 0:
                print(f"vigil job: job {args.name} is being ended by someone else",
                      file=sys.stderr)
                return 1
            print(f"job {args.name} deleted; {n} open request(s) failed job_deleted")
    except VigilError as e:
        print(f"vigil job: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    path = build_tiny_llama(args.dir)
    print(f"built tiny-llama in {path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(n=args.n, max_tokens=args.max_tokens, keep=args.keep)


def _cmd_batch(args: argparse.Namespace) -> int:
    return run_command(args.file, job=args.job, output=args.output, errors=args.errors,
                       window=args.window, quiet=args.quiet)


def _cmd_api(args: argparse.Namespace) -> int:
    settings = get_settings()
    try:
        address = listen_address(args, settings)
    except ApiAuthMissing as e:
        print(f"vigil api: {e}", file=sys.stderr)
        return 2
    if not settings.api_token.get_secret_value():
        print("vigil api: no token (VIGIL_API_AUTH_DISABLED); for local use only",
              file=sys.stderr)
    print(f"vigil api: OpenAI completions, chat completions, Files and Batches on "
          f"http://{address}:{args.port}/v1 ({args.workers} process(es))", file=sys.stderr)
    serve(args, settings)
    return 0


def _cmd_api_key(args: argparse.Namespace) -> int:
    keys = open_store(get_settings()).api_keys()
    if args.action == "create":
        if args.job is not None and not valid_job(args.job):
            print(f"vigil api-key: bad job name {args.job!r}", file=sys.stderr)
            return 2
        token = keys.create(args.name, args.job, args.max_tier)
        print(token)
        print(f"vigil api-key: {args.name}: job {args.job or '(any the caller names)'}, tiers "
              f"up to {args.max_tier}; the key is shown once", file=sys.stderr)
        return 0
    if args.action == "list":
        rows = keys.list()
        if args.json:
            print(json.dumps(rows, indent=2))
        for k in rows if not args.json else ():
            print(f"{k['id']}  {k['name']:<20} job={k['job'] or '*':<20} "
                  f"max_tier={k['max_tier']}")
        return 0
    gone = keys.revoke(args.name)
    print(f"vigil api-key: revoked {gone} key(s)", file=sys.stderr)
    return 0 if gone else 1


def _cmd_request(args: argparse.Namespace) -> int:
    if args.id[0] == "cancel" and len(args.id) > 1:
        return _cancel_requests(args.id[1:], args.json)
    if len(args.id) > 1:
        print("vigil request: give one request id (or `cancel ID [ID ...]`)", file=sys.stderr)
        return 2
    rid = args.id[0]
    if args.follow:
        # The results' app: its AsyncResult reads the token stream.
        return follow_request(shared_app(), rid, after=args.after, timeout=args.timeout)
    return run_request(rid, as_json=args.json, show_text=args.show_text)


def _cancel_requests(ids: list[str], as_json: bool) -> int:
    """`vigil request cancel ID ...`: each open request ends `cancelled` and stops in its engine
    (app/fleet/cancel.py); prints what happened to each. 0 when every one was cancelled now, 1
    when some had already ended or are unknown (nothing was changed for those)."""
    app = shared_app()
    try:
        done = cancel_requests(app.vigil_store, ids, backend=app.backend,
                               bus=app.vigil_ports.bus, reason="cancelled by an operator "
                               "(vigil request cancel)")
    except VigilError as e:
        print(f"vigil request: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(done))
    else:
        for rid, what in done.items():
            print(f"{rid}: {what}")
    return 0 if all(what == ENDED_NOW for what in done.values()) else 1


def _gpu_spec(text: str) -> tuple[int, ...]:
    try:
        return parse_gpu_spec(text)
    except GpuSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `vigil`."""
    p = argparse.ArgumentParser(prog="vigil", description="Fault-tolerant LLM inference on Celery.")
    sub = p.add_subparsers(dest="cmd", required=True)

    w = sub.add_parser("worker", help="run a worker (one per GPU)")
    dev = w.add_mutually_exclusive_group(required=True)
    dev.add_argument("--gpu", type=_gpu_spec, metavar="N[,M|-M]",
                     help="pin to GPU N, or to several (0,1 or 0-3: one tensor-parallel "
                     "engine over them); N counts within an inherited CUDA_VISIBLE_DEVICES")
    dev.add_argument("--cpu", action="store_true", help="run on the CPU (no GPU)")
    w.add_argument("--name", help="Celery node name (default gpuN@%%h, gpuN-M@%%h or cpu@%%h)")
    w.add_argument("--pools", help="comma-separated models to serve and preload (default: all "
                   "registered pools, loaded on first use)")
    w.add_argument("--concurrency", type=int, help="requests in flight (VIGIL_WORKER_CONCURRENCY)")
    w.add_argument("--loglevel", help="log level (default VIGIL_LOG_LEVEL, INFO)")
    w.set_defaults(func=run_worker)

    hk = sub.add_parser("housekeeper", help="run beat's tasks (sweeps, reaper, reconcile) on "
                        "threads of their own, never an engine")
    hk.add_argument("--name", help="Celery node name (default housekeeper@%%h)")
    hk.add_argument("--concurrency", type=int,
                    help="threads (VIGIL_HOUSEKEEPER_CONCURRENCY, default 4)")
    hk.add_argument("--loglevel", help="log level (default VIGIL_LOG_LEVEL, INFO)")
    hk.set_defaults(func=run_housekeeper)

    st = sub.add_parser("status", help="workers (health, in flight, memory) and pools")
    st.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    st.add_argument("--watch", type=float, metavar="SECONDS", help="refresh until Ctrl-C")
    st.add_argument("--wide", action="store_true", help="every column: instance, engine, "
                    "memory, last failure (the default fits 80 columns)")
    st.set_defaults(func=_cmd_status)

    j = sub.add_parser("job", help="jobs: named submitter sessions (app/fleet/jobs.py)")
    jsub = j.add_subparsers(dest="job_cmd", required=True)
    jc = jsub.add_parser("create", help="create or update a job")
    jc.add_argument("name")
    jc.add_argument("--replicas", type=int, default=1, help="workers the job wants on its pool")
    jc.add_argument("--lease", type=float, help="seconds without submit/poll before it is "
                    "abandoned (default VIGIL_JOB_LEASE, else the request deadline)")
    jl = jsub.add_parser("list", help="live jobs")
    jl.add_argument("--json", action="store_true")
    jd = jsub.add_parser("delete", help="delete a job: its open requests fail job_deleted")
    jd.add_argument("name")
    j.set_defaults(func=_cmd_job)

    m = sub.add_parser("model", help="model tools")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    bt = msub.add_parser("build-tiny", help="build tiny-llama into DIR")
    bt.add_argument("dir")
    bt.set_defaults(func=_cmd_model)

    m = sub.add_parser("metrics", help="serve the fleet's gauges for Prometheus: per pool and "
                       "tier, waiting, running, the oldest wait, workers (for autoscaling)")
    m.add_argument("--port", type=int, default=DEFAULT_METRICS_EXPORTER_PORT,
                   help="port to listen on (default %(default)s)")
    m.add_argument("--address", default="0.0.0.0", help="address to listen on (default all)")
    m.set_defaults(func=_cmd_metrics)

    f = sub.add_parser("flower", help="run Flower (celery -A app flower) behind basic auth")
    f.add_argument("--port", type=int, default=DEFAULT_FLOWER_PORT,
                   help="port to listen on (default %(default)s)")
    f.add_argument("--address", help="address to listen on (default: all interfaces; "
                   f"{FLOWER_LOCAL_ADDRESS} when auth is disabled)")
    f.set_defaults(func=_cmd_flower)

    d = sub.add_parser("demo", help="run the end-to-end demo on a private Redis")
    d.add_argument("--n", type=int, default=100, help="prompts to send")
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--keep", action="store_true", help="leave the fleet and Flower running "
                   "after the summary, until Ctrl-C")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("batch", help="run an OpenAI Batch input file (JSONL) through Vigil; "
                       "rerun the same command to resume. Batch objects kept by the fleet: "
                       "vigil batch submit|status|list|cancel|results (vigil batch submit -h)",
                       description="vigil batch FILE runs a file from this terminal; "
                       "vigil batch submit FILE stores it in the fleet, which runs it "
                       "(then: status, list, cancel, results; docs/batch.md)")
    b.add_argument("file", help="input JSONL: one {custom_id, method, url, body} per line")
    b.add_argument("--job", help="job name; with custom_id it fixes each request's id (default: "
                   "the file name, FILE.jsonl -> FILE)")
    b.add_argument("--output", help="successes, appended (default FILE.output.jsonl)")
    b.add_argument("--errors", help="failures, rewritten each run (default FILE.errors.jsonl)")
    b.add_argument("--window", type=int, default=512,
                   help="most requests in flight at once (default %(default)s)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=_cmd_batch)

    a = sub.add_parser("api", help="serve OpenAI's Files and Batches endpoints (the official "
                       "openai client works against it) behind VIGIL_API_TOKEN")
    a.add_argument("--port", type=int, default=DEFAULT_API_PORT,
                   help="port to listen on (default %(default)s)")
    a.add_argument("--address", help="address to listen on (default: all interfaces; "
                   "127.0.0.1 when auth is disabled)")
    a.add_argument("--loglevel", help="log level (default VIGIL_LOG_LEVEL, INFO)")
    a.add_argument("--workers", type=int, default=1,
                   help="processes serving the port (default %(default)s)")
    a.set_defaults(func=_cmd_api)

    k = sub.add_parser("api-key", help="the online API's keys: create (printed once), list, "
                       "revoke (by id or name); a key names its job and highest tier")
    k.add_argument("action", choices=["create", "list", "revoke"])
    k.add_argument("name", nargs="?", default="", help="the key's name (create), or its id "
                   "or name (revoke)")
    k.add_argument("--job", help="the job its requests run under (default: the job a request "
                   "names, X-Vigil-Job)")
    k.add_argument("--max-tier", default="interactive",
                   choices=["interactive", "default", "bulk"],
                   help="the highest tier it may ask for (default %(default)s)")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_api_key)

    r = sub.add_parser("request", help="one request: status, attempts, result or error, and "
                       "while it waits, why")
    r.add_argument("id", nargs="+", metavar="ID",
                   help="the request id (= the Celery task id); `cancel ID [ID ...]` cancels "
                   "requests: each open one ends `cancelled` and stops in its engine")
    r.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    r.add_argument("--show-text", action="store_true",
                   help="include the generated text and token ids (user data)")
    r.add_argument("--follow", action="store_true",
                   help="print the generated text as it comes (the token stream) until the "
                   "request ends")
    r.add_argument("--after", type=int, default=0,
                   help="with --follow: start after this many tokens (default 0)")
    r.add_argument("--timeout", type=float, default=None,
                   help="with --follow: give up after this many seconds")
    r.set_defaults(func=_cmd_request)
    return p


def batch_objects_parser() -> argparse.ArgumentParser:
    """The parser of `vigil batch submit|status|list|cancel|results` (app/ops/batch_cli.py)."""
    p = argparse.ArgumentParser(prog="vigil batch", description="Batch objects kept by the "
                                "fleet (docs/batch.md)")
    sub = p.add_subparsers(dest="batch_cmd", required=True)
    batch_cli.add_parsers(sub)
    p.set_defaults(func=batch_cli.run)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vigil` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "batch" and argv[1] in batch_cli.SUBCOMMANDS:
        args = batch_objects_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SettingsError as e:
        print(f"vigil: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
