#!/usr/bin/env python3
"""Celery's own integration tests as workhorse's yardstick.

Downloads the sdist of the installed Celery from the package index, then runs its
``t/integration/test_tasks.py`` and ``t/integration/test_canvas.py`` twice, unmodified, with
Celery as the client: once against Celery's own prefork worker (the baseline) and once
against a workhorse worker, each started as a subprocess the same way (``suite_plugin.py``
points the suite's session-worker fixture at it; ``--baseline in-process`` runs the suite's
own fixture, a Celery worker inside the test process, instead). Broker and results are on
Redis, in databases of their own. Prints, per file, how many tests passed under each worker
and, by name, the tests that pass under Celery and not under workhorse. Tests that do not
pass under the Celery baseline are not counted; no other test is excluded.

    pip install -e '.[test]'
    python compat/celery_suite.py                 # both files, both workers (~40 min)
    python compat/celery_suite.py --parallel      # both workers at once (~25 min)
    python compat/celery_suite.py -k "chain"      # a subset (pytest -k)
    python compat/celery_suite.py --only workhorse -k test_tasks   # one worker, one file
    python compat/celery_suite.py --table         # the table from the last runs' reports
    python compat/celery_suite.py --set control   # inspect/control, group chains, Redis results

Exit status: 0 when every test that passes under Celery passes under workhorse; 1
otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The files (or tests, file::name) each set runs: --set.
SETS = {
    "workflows": ("test_tasks.py", "test_canvas.py"),
    "control": ("test_inspect.py", "test_group_chains.py", "test_redis_backend.py",
                "test_worker.py::test_pidbox_reset_after_repeated_control_errors"),
}
FILES: tuple[str, ...] = SETS["workflows"]


def file_of(entry: str) -> str:
    return entry.split("::", 1)[0]


def sdist(workdir: Path) -> Path:
    """The celery sdist matching the installed Celery, downloaded once into ``workdir``."""
    version = importlib.metadata.version("celery")
    root = workdir / f"celery-{version}"
    if (root / "t" / "integration").is_dir():
        return root
    workdir.mkdir(parents=True, exist_ok=True)
    archive = workdir / f"celery-{version}.tar.gz"
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"celery=={version}", "-d", str(workdir)],
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    return root


def report_name(worker: str, args: argparse.Namespace) -> str:
    return f"{worker}-{args.report_name}" if args.report_name else worker


def start(root: Path, worker: str, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """Start the files' run against ``worker`` ("celery" or "workhorse")."""
    db_broker, db_backend = (args.databases[0], args.databases[1]) if worker == "celery" \
        else (args.databases[2], args.databases[3])
    env = dict(os.environ)
    env.update(
        TEST_BROKER=f"{args.redis}/{db_broker}", TEST_BACKEND=f"{args.redis}/{db_backend}",
        PYTHONPATH=os.pathsep.join([str(root), str(HERE), env.get("PYTHONPATH", "")]),
        SUITE_WORKER=worker, SUITE_CONCURRENCY=str(args.concurrency),
        SUITE_WORKER_LOG=str(args.workdir / f"{report_name(worker, args)}-worker.log"),
    )
    if worker == "celery" and args.baseline == "in-process":
        del env["SUITE_WORKER"]
    for url in (env["TEST_BROKER"], env["TEST_BACKEND"]):
        subprocess.run(["redis-cli", "-u", url, "flushdb"], check=False, capture_output=True)
    command = [sys.executable, "-m", "pytest", "-p", "suite_plugin", "-p", "celery.contrib.pytest",
               "-o", "addopts=", "-q", "-rN", "--timeout", str(args.timeout),
               f"--junitxml={args.workdir / f'{report_name(worker, args)}.xml'}",
               "-p", "no:cacheprovider"]
    if not args.reruns:
        command += ["-p", "no:rerunfailures"]
    if args.k:
        command += ["-k", args.k]
    command += [f"t/integration/{name}" for name in FILES]
    output = args.workdir / f"{report_name(worker, args)}-pytest.log"
    print(f"== {worker}: {' '.join(command[3:])}\n   output: {output}", flush=True)
    with open(output, "wb") as log:
        return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def outcomes(report: Path) -> dict[str, dict[str, str]]:
    by_file: dict[str, dict[str, str]] = {file_of(name): {} for name in FILES}
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        name = case.get("name", "")
        file = next((f"{part}.py" for part in module if f"{part}.py" in by_file), None)
        if file is None:
            continue
        cls = [part for part in module[module.index(file[:-3]) + 1:]]
        test = "::".join([*cls, name])
        kinds = {child.tag for child in case}
        result = ("failed" if kinds & {"failure", "error"} else
                  "skipped" if "skipped" in kinds else "passed")
        by_file[file][test] = result
    return by_file


def table(celery: dict[str, dict[str, str]], workhorse: dict[str, dict[str, str]]) -> int:
    missing_total = 0
    rows = ["| file | passed under Celery | passed under workhorse | "
            "of those, not under workhorse |", "|---|---|---|---|"]
    details: list[str] = []
    for file in dict.fromkeys(map(file_of, FILES)):
        baseline = {t for t, r in celery[file].items() if r == "passed"}
        ours = {t for t, r in workhorse[file].items() if r == "passed"}
        missing = sorted(baseline - ours)
        missing_total += len(missing)
        rows.append(f"| {file} | {len(baseline)} | {len(baseline & ours)} | {len(missing)} |")
        for label, names in (("not under workhorse", missing),
                             ("pass under workhorse only (not counted)", sorted(ours - baseline)),
                             ("do not pass under Celery (not counted)",
                              sorted(set(celery[file]) - baseline))):
            if names:
                details.append(f"{file}, {label}:")
                details.extend(f"  {name}  [{celery[file].get(name, '-')} / "
                               f"{workhorse[file].get(name, '-')}]" for name in names)
    print("\n".join(["", *rows, "", *details]))
    return missing_total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=HERE / ".suite",
                        help="where the sdist, reports and the worker's log go")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--databases", type=int, nargs=4, default=[10, 11, 12, 13],
                        metavar="N", help="Redis databases: Celery broker, Celery results, "
                        "workhorse broker, workhorse results (default 10 11 12 13)")
    parser.add_argument("--timeout", type=int, default=60, help="per test, seconds")
    parser.add_argument("--reruns", action="store_true",
                        help="honour the suite's flaky markers (needs pytest-rerunfailures); "
                        "off: one try each")
    parser.add_argument("--only", choices=("celery", "workhorse"),
                        help="run against one worker; the table needs both")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="pool size of both workers (default 1, as the suite's fixture)")
    parser.add_argument("--baseline", choices=("subprocess", "in-process"),
                        default="subprocess",
                        help="run Celery's worker as a subprocess like workhorse (default) or "
                        "in the test process, as the suite's own fixture does")
    parser.add_argument("--parallel", action="store_true",
                        help="run against both workers at once (their own Redis databases); "
                        "halves the time, but a loaded machine may fail timing-bound tests")
    parser.add_argument("--table", action="store_true",
                        help="run nothing: print the table from the last runs' reports")
    parser.add_argument("--report-name", metavar="NAME",
                        help="name the reports and logs <worker>-NAME (default <worker>)")
    parser.add_argument("-k", help="a pytest -k expression selecting a subset")
    parser.add_argument("--set", choices=sorted(SETS), default="workflows",
                        help="which of Celery's files: workflows (test_tasks, test_canvas; "
                        "the default) or control (test_inspect, test_group_chains, "
                        "test_redis_backend, test_worker's pidbox reset test)")
    args = parser.parse_args()
    global FILES
    FILES = SETS[args.set]
    if args.set != "workflows" and not args.report_name:
        args.report_name = args.set
    args.workdir = args.workdir.resolve()
    workers = [w for w in ("celery", "workhorse") if args.only in (None, w)]
    if not args.table:
        root = sdist(args.workdir)
        if args.parallel:
            for run in [start(root, worker, args) for worker in workers]:
                run.wait()
        else:
            for worker in workers:
                start(root, worker, args).wait()
    results = {worker: outcomes(args.workdir / f"{report_name(worker, args)}.xml")
               for worker in workers}
    if args.only:
        for file, tests in results[args.only].items():
            print(file, sum(r == "passed" for r in tests.values()), "passed of", len(tests))
        return 0
    return 1 if table(results["celery"], results["workhorse"]) else 0


if __name__ == "__main__":
    sys.exit(main())
