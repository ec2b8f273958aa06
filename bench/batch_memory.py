"""What a batch object costs Redis in memory, per line.

    python -m bench.batch_memory [--lines 10000] [--text-bytes 40]

On a private redis-server (no fleet): uploads a file of `--lines` completion lines (the lines of
bench/batch_objects.py), creates its batch, then records an output line for every line through
the batch store's own script, reading Redis' `used_memory` (INFO memory) before and after each
step. Prints the bytes per line of the stored file and of the recorded results, each against
the bytes of the lines themselves (the ratio is Redis' own overhead: list and hash entries).
The requests' own records are not counted: docs/scale.md gives those (3,249 bytes per open
request, and an ended one is kept for VIGIL_RESULT_TTL).
"""
from __future__ import annotations

import argparse
import json
import sys

import redis

from app.fleet import batches
from app.local.embedded import EmbeddedRedis
from app.requests import batch_file as fmt
from app.settings import load_settings
from app.state.batches import BatchStore
from bench.batch_objects import make_lines

NOW = 1_800_000_000.0


def measure(n: int, text_bytes: int) -> dict:
    """{"file", "stored", "output", "recorded"}: the file's bytes and the Redis memory its
    upload took; the output lines' bytes and the Redis memory recording them took."""
    rds = EmbeddedRedis().start()
    try:
        client = redis.Redis.from_url(rds.url)
        bs = BatchStore(client)
        settings = load_settings(redis_url=rds.url)

        def used() -> int:
            return client.info("memory")["used_memory"]

        lines = make_lines(n, 8)
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        before = used()
        f = batches.upload_file(bs, data, "memory.jsonl", "batch", NOW, settings)
        stored = used() - before
        b = batches.create_batch(bs, f["id"], "/v1/completions", "24h", None, NOW, settings)
        result = {"model": "tiny-llama", "text": "x" * text_bytes, "finish_reason": "length",
                  "prompt_tokens": 12, "completion_tokens": 8}
        outs = []
        for i, x in enumerate(lines):
            rid = fmt.request_id_for("memory", x["custom_id"])
            line = fmt.dumps(fmt.success_line(rid, x["custom_id"], "completion", result,
                                              int(NOW))).rstrip("\n")
            outs.append((i + 1, True, line, ""))
        before = used()
        for k in range(0, n, 500):
            bs.record(b["id"], outs[k:k + 500])
        return {"file": len(data), "stored": stored, "output": sum(len(o[2]) for o in outs),
                "recorded": used() - before}
    finally:
        rds.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--text-bytes", type=int, default=40, help="generated text per result")
    args = p.parse_args(argv)
    m = measure(args.lines, args.text_bytes)
    n = args.lines
    print(f"file: {m['file']:,} bytes ({m['file'] / n:.0f} a line); stored in Redis: "
          f"{m['stored']:,} bytes ({m['stored'] / n:.0f} a line, ratio "
          f"{m['stored'] / m['file']:.2f})")
    print(f"results: {m['output']:,} bytes of output lines ({m['output'] / n:.0f} a line); "
          f"recorded: {m['recorded']:,} bytes ({m['recorded'] / n:.0f} a line, ratio "
          f"{m['recorded'] / m['output']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
