"""Task states, as Celery names and stores them."""
from __future__ import annotations

PENDING = "PENDING"
STARTED = "STARTED"
RETRY = "RETRY"
SUCCESS = "SUCCESS"
FAILURE = "FAILURE"
REVOKED = "REVOKED"

READY_STATES = frozenset({SUCCESS, FAILURE, REVOKED})
EXCEPTION_STATES = frozenset({RETRY, FAILURE, REVOKED})
