"""When to retry: the back-off schedule, and which exceptions retry automatically. Pure."""
from __future__ import annotations

import random
from collections.abc import Sequence


def retry_countdown(retries: int, *, backoff: bool | int, backoff_max: float, jitter: bool,
                    default_delay: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``retries + 1``.

    Without back-off: ``default_delay``. With it (``True`` = base 1, or an integer base):
    ``min(base × 2**retries, backoff_max)``, and with jitter a uniform draw in [0, that].
    """
    if backoff is False or backoff is None or backoff == 0:
        return float(default_delay)
    base = 1 if backoff is True else int(backoff)
    countdown = float(min(base * 2 ** retries, backoff_max))
    if jitter:
        countdown = (rng or random).uniform(0, countdown)
    return countdown


def should_autoretry(exc: BaseException, retry_for: Sequence[type[BaseException]],
                     dont_retry_for: Sequence[type[BaseException]]) -> bool:
    return isinstance(exc, tuple(retry_for)) and not isinstance(exc, tuple(dont_retry_for))
