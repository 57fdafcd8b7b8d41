"""What writing a job frame costs with its message's objects in the CPU's caches, and out.

    python benchmarks/frame_cost.py [--jobs 400] [--thrash-mb 32]

Builds jobs as the supervisor does from a Celery client's message (its headers, delivery
information and properties decoded from JSON, each job's objects its own), then times
``ipc.encode`` on them: hot (each job encoded just before), and cold (``--thrash-mb`` of
memory written between two encodes, as the children, the broker's answer and the rest of
a turn stand between a message's arrival and its job's start in a worker). Medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workhorse.pool import ipc
from workhorse.protocol import build_message


def job(seq: int) -> ipc.Job:
    built = build_message("bench.noop", str(uuid.uuid4()), [], {}, ignore_result=True)
    headers = json.loads(json.dumps(built.headers))
    info = {"exchange": "", "routing_key": "bench", "delivery_count": 1}
    properties = json.loads(json.dumps({
        "correlation_id": headers["id"], "reply_to": "", "delivery_mode": 2,
        "delivery_info": info, "priority": 0, "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4())}))
    return ipc.Job(seq, "bench.noop", json.dumps([[], {}, {"callbacks": None}]).encode(),
                   "application/json", "utf-8", headers, {**info, "priority": 0}, False,
                   "bench", 0, True, f"w@host:1:{seq}", 30.0, properties)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--thrash-mb", type=int, default=32)
    args = parser.parse_args()
    jobs = [job(n) for n in range(2 * args.jobs)]
    junk = bytearray(args.thrash_mb << 20)
    hot, cold = [], []
    for one in jobs[:args.jobs]:
        ipc.encode(one)
        started = time.perf_counter_ns()
        ipc.encode(one)
        hot.append(time.perf_counter_ns() - started)
    for one in jobs[args.jobs:]:
        junk[::64] = bytes(len(junk[::64]))      # every cache line written
        started = time.perf_counter_ns()
        ipc.encode(one)
        cold.append(time.perf_counter_ns() - started)
    print(f"a job frame ({len(ipc.encode(jobs[0]))} bytes): hot "
          f"{statistics.median(hot) / 1000:.1f} µs, cold {statistics.median(cold) / 1000:.1f} µs "
          f"(medians of {args.jobs} each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
