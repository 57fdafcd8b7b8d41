"""Changing a running worker: a reload (SIGHUP) applies the config files and task modules as
they are on disk now; TTIN/TTOU grow or shrink the pool by one."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..app import result_retry_policy
from ..backends import RetryPolicy
from ..config import SETTINGS, Settings
from . import systemd
from .autoscale import clamp
from .current import Current
from .holding import Holding, windows
from .settlement import Settlement
from .slots import Recycling, Slots

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("workhorse.supervisor")

#: TTIN / TTOU keep the pool within these bounds (those of the concurrency setting).
POOL_MIN, POOL_MAX = 1, 1024

#: Reads the config files and imports the task modules again; raises if they are broken.
Load = Callable[[], "tuple[Settings, App]"]


def keep_restart_only(running: Settings, loaded: Settings) -> Settings:
    """The settings a reload applies: ``loaded``, but those that need a restart keep their
    running values (each change is logged)."""
    values = loaded.as_dict()
    for setting in SETTINGS:
        name = setting.name
        if not setting.reload and values[name] != running[name]:
            log.warning("reload: %s changed to %r, which needs a restart; still %r", name,
                        values[name], running[name])
            values[name] = running[name]
    return Settings(values, {s.name: loaded.source(s.name) for s in SETTINGS},
                    loaded.config_files, loaded.schedule)


class Reload:
    def __init__(self, current: Current, load: Load | None, slots: Slots, holding: Holding,
                 settlement: Settlement, clock: Callable[[], float],
                 on_change: Callable[[], None]) -> None:
        self.current = current
        self.load = load
        self.slots = slots
        self.holding = holding
        self.settlement = settlement
        self.clock = clock
        self.on_change = on_change
        #: Told the settings and app a reload applied (the schedule thread's entries).
        self.on_reloaded: Callable[[Settings, App], None] | None = None

    def reload(self) -> None:
        """Read config and code again; every child is replaced by one forked afterwards
        (idle ones now, busy ones when done). Nothing held is given back, re-run or waited
        on. A config or module that fails to load leaves everything as it was."""
        if self.load is None:
            log.warning("SIGHUP received, but this supervisor has nothing to reload from")
            return
        systemd.notify(f"RELOADING=1\nMONOTONIC_USEC={int(self.clock() * 1e6)}\n"
                       "STATUS=reloading (SIGHUP)")
        log.info("SIGHUP: reloading the configuration and the task modules")
        try:
            settings, app = self.load()
        except Exception as exc:  # noqa: BLE001 - a bad config or module: keep running as is
            log.error("reload failed, still running the configuration and code loaded before: "
                      "%s", exc)
            systemd.notify(f"READY=1\nSTATUS=reload failed ({exc}); {self._consuming()}")
            return
        self._apply(keep_restart_only(self.current.settings, settings), app)
        systemd.notify(f"READY=1\nSTATUS={self._consuming()}")

    def _apply(self, settings: Settings, app: App) -> None:
        # The supervisor makes one store attempt per call; its loop timers retry.
        app.backend.retry_policy = RetryPolicy(always_retry=False)
        self.current.app, self.current.settings = app, settings
        self.settlement.retry = result_retry_policy(settings)
        self.slots.recycling = Recycling(settings.max_tasks_per_child,
                                         settings.max_memory_per_child)
        logging.getLogger().setLevel(settings.loglevel)
        self.slots.loop_block_limit = settings.loop_block_limit
        self.slots.renew()
        # With autoscale the pool keeps the size it has grown or shrunk to.
        size = (clamp(self.slots.size, settings.autoscale) if settings.autoscale
                else settings.concurrency)
        self.resize(size, "reload")
        log.info("reloaded: %d children, tasks %s", size,
                 ", ".join(sorted(app.tasks)) or "(none registered)")
        if self.on_reloaded is not None:
            self.on_reloaded(settings, app)

    def resize(self, size: int, why: str) -> None:
        """Grow or shrink the pool to ``size`` children; the prefetch window follows."""
        if not POOL_MIN <= size <= POOL_MAX:
            log.warning("%s: the pool stays at %d children (between %d and %d)", why,
                        self.slots.size, POOL_MIN, POOL_MAX)
            return
        s = self.current.settings
        window, async_window = windows(size, s.prefetch_multiplier, s.async_concurrency,
                                       self.current.app.tasks.values())
        if size != self.slots.size:
            self.slots.resize(size)
            log.info("%s: pool resized to %d children, prefetch window %d", why, size, window)
        if (window, async_window) != (self.holding.window, self.holding.async_window):
            self.holding.set_windows(window, async_window)
            self.on_change()

    def _consuming(self) -> str:
        return f"consuming {', '.join(self.current.settings.queues)}"
