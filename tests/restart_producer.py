"""A producer process for tests/test_redis_restart_e2e.py: submits requests at a steady pace
through `generate.delay` while Redis restarts under it, then waits on every one with `r.get()`.

    python -m tests.restart_producer OUT_DIR N RATE

Writes OUT_DIR/accepted.jsonl (one line per `.delay` that returned: id and time, flushed at once,
so the test knows what was accepted before each restart), then OUT_DIR/outcomes.json ({id:
"ok" | error code}) once every accepted request has ended. A submit that raises TransientError
(redis_unavailable while Redis is down) is retried after a short pause, as a real producer would.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def main(out: Path, n: int, rate: float) -> int:
    """Submit `n` requests at `rate` per second, then collect their outcomes."""
    from app.errors import TransientError, VigilError
    from tasks.inference import generate

    accepted = []
    refused = 0
    with open(out / "accepted.jsonl", "w") as log:
        for i in range(n):
            while True:
                try:
                    r = generate.delay(model="tiny-llama", prompt=f"restart test {i}: tell me",
                                       max_tokens=24)
                    break
                except TransientError:
                    refused += 1
                    time.sleep(0.2)
            accepted.append(r)
            log.write(json.dumps({"id": r.id, "t": time.time()}) + "\n")
            log.flush()
            time.sleep(1 / rate)
    outcomes: dict[str, str] = {}

    def wait(r) -> None:
        try:
            r.get(timeout=300)
            outcomes[r.id] = "ok"
        except VigilError as e:
            outcomes[r.id] = e.code
        except Exception as e:  # a timeout, or anything else: the test reports it
            outcomes[r.id] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=wait, args=(r,)) for r in accepted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (out / "outcomes.json").write_text(json.dumps({"outcomes": outcomes,
                                                   "submits_refused": refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
