"""`vllm serve` with the model inside EngineCore, as Vigil's worker runs it (bench/online.py's
side "serve-uni").

    python -m bench.serve_uni --model MODEL [vllm serve's flags]

vLLM's CPU platform turns `--distributed-executor-backend uni` into "mp" (a model process of
its own below EngineCore); the executor class itself is left alone (docs/field-notes.md, "The
CPU's engine layout"), and no flag can name a class. So this runs vLLM's own `vllm serve`
(its OpenAI API server, as `python -m vllm.entrypoints.openai.api_server` starts it) with one
change: the engine args its command line parses get `distributed_executor_backend =
UniProcExecutor`, the value workers/engine/vllm_args.py `executor_args` gives the worker.
Everything else is `vllm serve` as shipped.
"""
from __future__ import annotations

import sys


def main() -> int:
    """Run `vllm serve` with the worker's executor class (module docstring)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    parse = EngineArgs.from_cli_args.__func__

    def from_cli_args(cls, args):
        engine_args = parse(cls, args)
        engine_args.distributed_executor_backend = UniProcExecutor
        return engine_args

    EngineArgs.from_cli_args = classmethod(from_cli_args)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = ["vllm-serve-uni", *sys.argv[1:]]
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
