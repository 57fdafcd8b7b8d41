"""Tasks the integration tests run in a real worker. Settings come from WORKHORSE_* env.

Tasks that tests count record each start as a line in the file named by
$WORKHORSE_TEST_RUNLOG (one line per start: "<name> <task id> <pid>").
"""
from __future__ import annotations

import fcntl
import os
import signal
import stat
import struct
import subprocess
import time
from pathlib import Path

from workhorse import App, SoftTimeLimitExceeded, group
from workhorse.backends.sqlite import SQLiteBackend

app = App("basic")


def _record(name: str, task_id: str | None) -> None:
    path = os.environ.get("WH_TEST_RUNLOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {task_id} {os.getpid()}\n")


@app.task
def add(x, y):
    return x + y


@app.task
def fail(message):
    raise ValueError(message, 42)


@app.task(bind=True)
def record(self, seconds=0.0):
    _record("record", self.request.id)
    if seconds:
        time.sleep(seconds)
    return self.request.id


@app.task(bind=True)
def context(self):
    r = self.request
    return {"id": r.id, "retries": r.retries, "root_id": r.root_id, "parent_id": r.parent_id,
            "hostname": r.hostname, "called_directly": r.called_directly,
            "routing_key": r.delivery_info.get("routing_key"),
            "correlation_id": r.properties.get("correlation_id")}


@app.task(bind=True)
def die(self, how="sigkill"):
    _record("die", self.request.id)
    if how == "exit":
        os._exit(7)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(bind=True)
def kill_supervisor(self):
    """SIGKILL the worker's supervisor (this child's parent), as the OOM killer would."""
    _record("kill_supervisor", self.request.id)
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)      # the child dies with its supervisor (PR_SET_PDEATHSIG)


@app.task(bind=True)
def sleeper(self, seconds):
    """Sleep in a grandchild process: the hard limit must kill it too."""
    _record("sleeper", self.request.id)
    proc = subprocess.Popen(["sleep", str(seconds)])
    with open(os.environ["WH_TEST_PIDFILE"], "w") as f:
        f.write(str(proc.pid))
    proc.wait()
    return "slept"


@app.task(bind=True)
def orphan(self, seconds):
    """Leave a process behind in a session of its own, out of the child's process group."""
    _record("orphan", self.request.id)
    proc = subprocess.Popen(["sleep", str(seconds)], start_new_session=True)
    with open(os.environ["WH_TEST_PIDFILE"], "w") as f:
        f.write(str(proc.pid))
    return "left behind"


@app.task(bind=True)
def soft_catch(self, seconds):
    try:
        time.sleep(seconds)
    except SoftTimeLimitExceeded:
        return "cleaned up"
    return "not interrupted"


@app.task
def unencodable():
    return object()


@app.task(bind=True)
def fork_and_return(self, linger=0.0):
    """Forks, and returns its pid in both processes. Without ``linger`` the original waits
    for the copy to return first; with it the original returns at once and the copy
    returns ``linger`` seconds later, while its child may be running the next task."""
    _record("fork_and_return", self.request.id)
    copy = os.fork()
    if copy == 0:
        _record("forked_copy", self.request.id)
        if linger:
            time.sleep(linger)
        return os.getpid()
    if not linger:
        os.waitpid(copy, 0)
    return os.getpid()


def _nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@app.task(bind=True)
def deep_result(self, depth=100_000):
    """Returns a list nested too deep for any JSON encoder."""
    _record("deep_result", self.request.id)
    return _nested(depth)


@app.task(bind=True)
def deep_error(self, depth=100_000):
    """Raises an exception whose argument is nested too deep for any JSON encoder."""
    _record("deep_error", self.request.id)
    raise ValueError(_nested(depth))


@app.task(bind=True)
def garble_frames(self):
    """Writes what is no frame into its child's pipe to the supervisor (the one pipe the
    child may write to), then waits to be killed for it."""
    _record("garble_frames", self.request.id)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
        except OSError:
            continue
        if is_pipe and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
            try:
                os.write(fd, struct.pack("!I", 4) + b"junk")
            except OSError:
                # EPIPE: the supervisor has read the junk already and closed its end (the
                # kill is on its way); raising here would end the task before the kill.
                pass
    time.sleep(60)
    return "not killed"


class CountingBackend(SQLiteBackend):
    """The tests' SQLite result store (the file conftest.worker_env names), recording each
    result it stores as a line "stored:<state> <task id> <pid>" in the run log.
    Use it with ``result_backend="tests.apps.basic:CountingBackend"``."""

    def __init__(self, url, **options):
        store = Path(os.environ["WH_TEST_RUNLOG"]).with_name("results.sqlite3")
        super().__init__(f"sqlite:///{store}", **options)

    def _set(self, task_id, state, payload):
        super()._set(task_id, state, payload)
        _record(f"stored:{state}", task_id)


_hoard: list[bytearray] = []


@app.task(bind=True)
def hog(self, mib):
    """Grow this child's memory by ``mib`` MiB and keep it."""
    _record("hog", self.request.id)
    _hoard.append(bytearray(mib * 1024 * 1024))
    return os.getpid()


@app.task(bind=True)
def c_compute(self):
    """Minutes of C code that never returns to the interpreter: no Python signal handler
    can run, only SIGKILL ends it."""
    _record("c_compute", self.request.id)
    import hashlib
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)
    return "finished"


@app.task(bind=True)
def soft_ignored(self, seconds):
    """Does not catch SoftTimeLimitExceeded."""
    _record("soft_ignored", self.request.id)
    time.sleep(seconds)
    return "not interrupted"


@app.task(bind=True)
def outlive_soft(self, seconds):
    """Catches SoftTimeLimitExceeded and sleeps on: only the hard limit ends it."""
    _record("outlive_soft", self.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(deadline - time.monotonic())
        except SoftTimeLimitExceeded:
            _record("outlive_soft:soft", self.request.id)
    return "outlived"


@app.task(bind=True)
def pid(self):
    _record("pid", self.request.id)
    return os.getpid()


# ---------------------------------------------------------------- retries and callbacks
from workhorse import Ignore, Reject  # noqa: E402


def _starts_of(task_id: str) -> int:
    path = os.environ.get("WH_TEST_RUNLOG")
    if not path or not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.split()[1] == task_id)


@app.task(bind=True)
def flaky(self, failures, countdown=0.3):
    """Fails (retrying) the first ``failures`` times, then succeeds."""
    _record("flaky", self.request.id)
    if self.request.retries < failures:
        raise self.retry(exc=ValueError("not yet"), countdown=countdown)
    return f"ok after {self.request.retries} retries"


@app.task(bind=True, max_retries=2)
def always_retry(self, with_exc=False):
    _record("always_retry", self.request.id)
    raise self.retry(exc=KeyError("gone") if with_exc else None, countdown=0.05)


@app.task(bind=True, autoretry_for=(ConnectionError,), default_retry_delay=0.05, max_retries=2)
def auto_flaky(self, failures):
    _record("auto_flaky", self.request.id)
    if self.request.retries < failures:
        raise ConnectionError(f"attempt {self.request.retries}")
    return self.request.retries


@app.task(bind=True, autoretry_for=(Exception,), dont_autoretry_for=(KeyError,),
          retry_kwargs={"countdown": 0.05, "max_retries": 5})
def auto_selective(self, error):
    _record("auto_selective", self.request.id)
    raise {"key": KeyError, "value": ValueError}[error]("boom")


@app.task(bind=True)
def retry_then_crash(self):
    """First delivery: send the retry, then die before the worker can settle."""
    _record("retry_then_crash", self.request.id)
    flag = os.environ["WH_TEST_PIDFILE"] + ".crashed"
    if not os.path.exists(flag):
        open(flag, "w").close()
        self.retry(countdown=0.2, throw=False)
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"


@app.task(bind=True, default_retry_delay=0.05)
def retry_with_new_args(self, a, b=0):
    """Retries once with new positional arguments; returns what the retry saw."""
    if self.request.retries == 0:
        raise self.retry(args=[a * 10, b * 10])
    return [a, b, self.request.headers.get("tenant")]


@app.task(bind=True)
def ignorer(self):
    _record("ignorer", self.request.id)
    raise Ignore()


@app.task(bind=True)
def rejecter(self, requeue):
    _record("rejecter", self.request.id)
    raise Reject("not for me", requeue=requeue)


@app.task(bind=True)
def reject_until_redelivered(self):
    """Requeues its first delivery; returns what a later one sees of its delivery."""
    info = self.request.delivery_info
    if not info.get("redelivered"):
        raise Reject("first time", requeue=True)
    return [info.get("redelivered"), info.get("priority")]


@app.task(bind=True, rate_limit="2/s")
def rated(self):
    """At most two starts a second in each worker; returns when it started (epoch s)."""
    return time.time()


@app.task
def errback_new(request, exc, traceback):
    """Called in the worker: writes what it was given to $WH_TEST_PIDFILE.errback."""
    with open(os.environ["WH_TEST_PIDFILE"] + ".errback", "a") as f:
        f.write(f"{request.id} {type(exc).__name__} {bool(traceback)} {request.task}\n")


@app.task
def errback_old(task_id):
    """Sent as a task with the failed task's id."""
    with open(os.environ["WH_TEST_PIDFILE"] + ".errback", "a") as f:
        f.write(f"old {task_id}\n")


@app.task
def errback_label(label, *failed_task_id):
    """An immutable errback (``errback_label.si("x")``): writes its label."""
    with open(os.environ["WH_TEST_PIDFILE"] + ".errback", "a") as f:
        f.write(f"label {label}\n")


@app.task
def errback_crashing(request, exc, traceback):
    raise RuntimeError("the errback itself fails")


@app.task
def mul(x, y):
    return x * y


# ---------------------------------------------------------------- results and workflows
@app.task(bind=True)
def collect(self, results):
    """A chord body: records its run, returns what it was given."""
    _record("collect", self.request.id)
    return results


@app.task(bind=True)
def gate(self, path, value):
    """Records its start, then returns ``value`` once the file ``path`` exists (at most 60 s):
    a test opens the gate when it has set up the fault the task should finish into."""
    _record("gate", self.request.id)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


@app.task(bind=True)
def spawn_children(self, n):
    return [add.delay(i, i).id for i in range(n)]


@app.task
def start_workflow(kind):
    """Returns the result of a workflow it started: an AsyncResult or a GroupResult."""
    if kind == "group":
        return group(add.s(i, i) for i in range(3)).apply_async()
    return add.delay(2, 2)


@app.task(bind=True)
def replace_with(self, kind):
    """Replaces itself, as Celery's Task.replace: by a task, a chain or a group."""
    replacement = {"task": add.si(2, 3), "chain": add.si(1, 1) | mul.s(10),
                   "group": group(add.si(1, 1), add.si(2, 2))}[kind]
    self.replace(replacement)


@app.task
def get_inside():
    return add.delay(1, 1).get(timeout=5)


# ---------------------------------------------------------------- idempotency
@app.task(bind=True, idempotent=True)
def once(self, seconds=0.0):
    """Idempotent on its task id."""
    _record("once", self.request.id)
    if seconds:
        time.sleep(seconds)
    return self.request.id


@app.task(bind=True, idempotent=lambda order_id: f"order-{order_id}")
def charge(self, order_id):
    """Idempotent on its argument: one charge per order, whatever the task id."""
    _record("charge", self.request.id)
    return order_id


@app.task(bind=True, idempotent=True)
def once_dies_first(self):
    """Killed on its first start, succeeds on its second."""
    _record("once_dies_first", self.request.id)
    if _starts_of(self.request.id) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "second time"


# ---------------------------------------------------------------- chaos
@app.task(bind=True)
def chaos_work(self, seconds):
    """Logs its start and its end (task id, pid, time) to $WH_CHAOS_LOG."""
    path = os.environ["WH_CHAOS_LOG"]
    with open(path, "a") as f:
        f.write(f"start {self.request.id} {os.getpid()} {time.time():.4f}\n")
    time.sleep(seconds)
    with open(path, "a") as f:
        f.write(f"end {self.request.id} {os.getpid()} {time.time():.4f}\n")
    return self.request.id
