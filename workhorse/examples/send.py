"""Queue the example tasks; with ``--wait``, wait for and print their results.

    python -m workhorse.examples.send            # queue and return
    python -m workhorse.examples.send --wait     # needs a running worker
"""
from __future__ import annotations

import argparse
import sys

from workhorse.examples.tasks import add, fail, slow, whoami


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait", action="store_true", help="wait for the results and print them")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait per result")
    args = parser.parse_args(argv)
    results = [("add(2, 3)", add.delay(2, 3)), ("slow(0.5)", slow.delay(0.5)),
               ("whoami()", whoami.delay()), ("fail('boom')", fail.delay("boom"))]
    for call, result in results:
        print(f"queued {call} as {result.id}")
    if not args.wait:
        return 0
    for call, result in results:
        value = result.get(timeout=args.timeout, propagate=False)
        print(f"{call} -> {result.state}: {value!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
