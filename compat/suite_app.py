"""The Celery app a workhorse worker runs for Celery's integration suite (``-A suite_app:app``).

It is the app the suite's own fixtures build (``t/integration/conftest.py``: broker and
backend from TEST_BROKER/TEST_BACKEND, ``result_extended``, the tasks of
``t.integration.tasks`` and the class-based task the suite registers by hand), so the
worker knows every task a test sends. Import it with the celery sdist's root on sys.path.
"""
import os

from celery import Celery

app = Celery("suite", broker=os.environ["TEST_BROKER"], backend=os.environ["TEST_BACKEND"])
app.conf.update(result_extended=True, task_create_missing_queues=False)

import t.integration.tasks as tasks  # noqa: E402  (shared tasks bind to the app above)

app.register_task(tasks.ClassBasedAutoRetryTask)
app.loader.import_default_modules()
