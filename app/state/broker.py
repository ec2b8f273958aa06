"""Reading (and dropping) what Celery's broker keeps in Redis: the queue lists and kombu's unacked
hash. Vigil never writes a message here itself (publishing goes through Celery:
app/requests/publish.py); it reads the lists to explain a wait, count a backlog or find a lost
message, and deletes a deleted job's queue.

kombu's Redis transport LPUSHes each message (a JSON envelope whose `headers.id` is the task id,
here the request id) onto one of the queue's lists, by its priority: the list named after the
queue for priority step 0, `<queue>\x06\x16<step>` for steps 3, 6 and 9 (Vigil's tiers:
app/requests/tiers.py); workers BRPOP the lowest step first, so the next message delivered is
the rightmost element of the first non-empty list. Every reader here reads all of a queue's
lists, in that order. A message fetched by a consumer and not yet acked
sits in the hash `unacked` (delivery tag -> [message, exchange, routing key]). Functions raise
redis' own errors.
"""
from __future__ import annotations

import json

import redis

from app.state.queues import POOL_QUEUE_GLOB

# kombu's Redis transport: messages delivered and not yet acked.
UNACKED_KEY = "unacked"
# Entries read per LRANGE / SCAN step.
CHUNK = 1000


def message_id(raw: bytes) -> str | None:
    """The task id (here the request id) of one kombu message as stored in a queue list, or None
    when the entry is not a kombu message."""
    try:
        return json.loads(raw)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None


def request_ids(raw: bytes) -> list[str]:
    """The request ids one kombu message carries: its task id, or for a message of many
    requests (vigil.generate_many) each id of its `vigil_ids` header; [] when the entry is not a
    kombu message."""
    try:
        headers = json.loads(raw)["headers"]
    except (ValueError, KeyError, TypeError):
        return []
    many = headers.get("vigil_ids") if isinstance(headers, dict) else None
    if isinstance(many, list):
        return [i for i in many if isinstance(i, str)]
    rid = headers.get("id") if isinstance(headers, dict) else None
    return [rid] if isinstance(rid, str) else []


# kombu's Redis transport keeps a queue's prioritised messages in sub-lists named
# "<queue>\x06\x16<step>" (its default priority steps 3, 6, 9; step 0 is the queue itself).
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (3, 6, 9)


def task_name(raw: bytes) -> str | None:
    """The task name (`headers.task`) of one kombu message as stored in a queue list, or None
    when the entry is not a protocol-2 task message."""
    try:
        task = json.loads(raw)["headers"]["task"]
    except (ValueError, KeyError, TypeError):
        return None
    return task if isinstance(task, str) else None


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold `queue`'s messages: the queue's own and its priority
    sub-lists."""
    return [queue] + [f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def messages_of_task(client: redis.Redis, list_key: str, task: str, *, limit: int,
                     chunk: int = CHUNK) -> list[bytes]:
    """The messages of `task` among the first `limit` entries of one queue list, read `chunk`
    entries at a time (LRANGE, nothing taken). The list may move while it is read: a message
    can be missed (the next scan finds it) or read twice (moving it twice moves it once)."""
    needle = task.encode()
    found: list[bytes] = []
    start = 0
    while start < limit:
        items = client.lrange(list_key, start, min(limit, start + chunk) - 1)
        found.extend(raw for raw in items if needle in raw and task_name(raw) == task)
        if len(items) < chunk:
            break
        start += chunk
    return found


def base_queue(list_key: str) -> str:
    """The queue a list belongs to (a priority sub-list's queue, or the list itself)."""
    return list_key.split(PRIORITY_SEP, 1)[0]


def depths(client: redis.Redis, queues: list[str]) -> list[int]:
    """The number of messages waiting in each of `queues`, every priority list of each (one
    pipelined round trip)."""
    if not queues:
        return []
    pipe = client.pipeline(transaction=False)
    per = len(queue_lists(""))
    for q in queues:
        for key in queue_lists(q):
            pipe.llen(key)
    n = [int(x) for x in pipe.execute()]
    return [sum(n[i:i + per]) for i in range(0, len(n), per)]


def depths_by_list(client: redis.Redis, queue: str) -> list[int]:
    """The messages waiting in each of `queue`'s lists, in the order workers pop them (step 0
    first)."""
    pipe = client.pipeline(transaction=False)
    for key in queue_lists(queue):
        pipe.llen(key)
    return [int(x) for x in pipe.execute()]


def requests_by_list(client: redis.Redis, queue: str, sample: int = 32) -> list[int]:
    """The requests waiting in each of `queue`'s lists, in the order workers pop them: a
    message of many requests (vigil.generate_many) counts each request it carries. Exact for a
    list of at most `sample` messages; past that, its length times the requests per message of
    the `sample` messages next to be popped (a batch's window is messages of one size)."""
    keys = queue_lists(queue)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
        pipe.lrange(key, -sample, -1)  # BRPOP pops from the right: the next ones
    replies = pipe.execute()
    out = []
    for n, raws in zip(replies[0::2], replies[1::2]):
        n = int(n)
        carried = [max(1, len(request_ids(raw))) for raw in raws]
        if not n or not carried:
            out.append(0)
        elif n <= len(carried):
            out.append(sum(carried))
        else:
            out.append(round(sum(carried) * n / len(carried)))
    return out


def all_pool_queues(client: redis.Redis) -> list[str]:
    """Every pool queue that exists in Redis now (its own and its jobs'; a queue whose messages
    are all in a priority list counts too), found by SCAN."""
    found = {base_queue(q.decode()) for q in client.scan_iter(match=POOL_QUEUE_GLOB, count=CHUNK,
                                                               _type="list")}
    return sorted(found)


def queued_ids(client: redis.Redis, queues: list[str], *, unacked: bool = False) -> set[str]:
    """Request ids with a message in one of `queues`, read CHUNK entries at a time; with
    `unacked`, also those in kombu's unacked hash (fetched by a consumer, not yet acked)."""
    ids: set[str] = set()
    for q in (key for queue in queues for key in queue_lists(queue)):
        start = 0
        while True:
            items = client.lrange(q, start, start + CHUNK - 1)
            for raw in items:
                ids.update(request_ids(raw))
            if len(items) < CHUNK:
                break
            start += CHUNK
    for _, raw in client.hscan_iter(UNACKED_KEY, count=CHUNK) if unacked else ():
        try:
            ids.update(request_ids(json.dumps(json.loads(raw)[0])))
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return ids


def position(client: redis.Redis, queue: str, request_id: str, *, limit: int,
             chunk: int = CHUNK) -> tuple[int | None, int]:
    """(position, length) of `request_id`'s message in `queue` (all its priority lists, in the
    order workers pop them): position 1 is the next message a worker receives; None when it is
    not among the first `limit` entries (or not there at all). Each list is read from the
    right, `chunk` entries at a time (LPOS cannot match a message: its bytes are not known to a
    reader). Approximate: the lists move while they are read."""
    lengths = depths_by_list(client, queue)
    length = sum(lengths)
    needle = request_id.encode()
    ahead = 0  # messages in the lists popped before this one
    for key, size in zip(queue_lists(queue), lengths):
        scanned = 0
        while scanned < size and ahead + scanned < limit:
            n = min(chunk, limit - ahead - scanned)
            items = client.lrange(key, -(scanned + n), -(scanned + 1))  # left to right
            for i, raw in enumerate(reversed(items)):  # head (rightmost) first
                if needle in raw and request_id in request_ids(raw):
                    return ahead + scanned + i + 1, length
            if len(items) < n:
                break
            scanned += n
        ahead += size
        if ahead >= limit:
            break
    return None, length


def next_ids(client: redis.Redis, queues: list[str]) -> list[str]:
    """The request id of the next message to be delivered from each of `queues` that has one
    (the oldest waiting in its first non-empty priority list)."""
    out = []
    for q in queues:
        for key in queue_lists(q):
            raw = client.lindex(key, -1)
            rids = request_ids(raw) if raw is not None else []
            if rids:
                out.append(rids[0])
                break
    return out


def delete_queue(client: redis.Redis, queue: str) -> None:
    """Drop a queue, its messages, and kombu's binding records for it (one set per queue a job
    ever had: left behind, they would pile up job after job)."""
    client.delete(*queue_lists(queue), f"_kombu.binding.{queue}",
                  f"_kombu.binding_permanent.{queue}")
