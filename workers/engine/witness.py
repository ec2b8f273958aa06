"""The witness: every generation the engine finished, written down by the engine side, for checks
that must not trust Vigil's own records.

With `VIGIL_WITNESS_DIR` set (tests, the soak; off in production), each worker process appends
one JSON line per finished generation to `<dir>/<pid>.jsonl`: the engine request id (`<request
id>-<attempt>`, with `.r<N>` for a re-run inside one attempt), the tokens generated and the time.
No Vigil code reads the file back: only checks do (tests/conftest.py `assert_witnessed`,
bench/soak_findings.py), comparing it with the stored results, so a generation that ran without
being recorded, or a stored result that no generation produced, is caught.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Witness:
    """Appends finished generations to this process's witness file (one line each, flushed)."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{os.getpid()}.jsonl"
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    def finished(self, engine_request_id: str, tokens: int) -> None:
        """Write down one finished generation."""
        self._file.write(json.dumps({"engine_request_id": engine_request_id, "tokens": tokens,
                                     "at": time.time()}) + "\n")


def read_witness(directory: Path) -> dict[str, list[dict]]:
    """Every generation the witnesses of `directory` saw, by request id (for checks): each
    {"attempt": int, "run": int (1 unless re-run inside the attempt), "tokens": int, "at"}."""
    out: dict[str, list[dict]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            rid, _, tail = entry["engine_request_id"].rpartition("-")
            attempt, _, run = tail.partition(".r")
            out.setdefault(rid, []).append({"attempt": int(attempt), "run": int(run or 1),
                                            "tokens": entry["tokens"], "at": entry["at"]})
    return out
