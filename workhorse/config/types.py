"""Value types for settings: each parses text (INI, env, CLI) and native values (TOML,
App keywords), validates, and says in one line what it accepts. ``parse_native`` is the
strict check for Python values given in code (task options), which are never text to read."""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

NONE_WORDS = frozenset({"none", ""})
_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


class Invalid(ValueError):
    """A value the type does not accept; the loader adds where it came from."""


@dataclass(frozen=True)
class ValueType:
    """A setting's type. ``parse`` takes text or a native value and returns the value."""

    accepted: str
    _parse: Callable[[Any], Any]
    optional: bool = False
    toml_name: str = "string"
    #: What a Python value of this type is, for a type whose values are not text (numbers,
    #: booleans); None when a str is a value of the type itself.
    native: str | None = None

    def parse(self, raw: Any) -> Any:
        if self.optional and (raw is None or (isinstance(raw, str)
                                              and raw.strip().lower() in NONE_WORDS)):
            return None
        return self._parse(raw)

    def parse_native(self, value: Any) -> Any:
        """A Python value as code gives it: text is not read as a number or a boolean, so
        ``"3"`` is not 3 and ``"no"`` is not False; ``None`` is the only "none"."""
        if self.optional and value is None:
            return None
        if self.native is None:
            return self._parse(value)
        if isinstance(value, str):
            raise Invalid(f"expected {self.describe_native()}")
        try:
            return self._parse(value)
        except Invalid:
            raise Invalid(f"expected {self.describe_native()}") from None

    def describe(self) -> str:
        return f"{self.accepted}, or none" if self.optional else self.accepted

    def describe_native(self) -> str:
        accepted = self.native or self.accepted
        return f"{accepted}, or None" if self.optional else accepted

    def or_none(self) -> ValueType:
        return replace(self, optional=True)


def boolean() -> ValueType:
    def parse(raw: Any) -> bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            word = raw.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
        raise Invalid("expected true or false")
    return ValueType("true or false (also yes/no, on/off, 1/0)", parse, toml_name="boolean",
                     native="True or False")


def boolean_or_integer(low: int) -> ValueType:
    """false, true, or an integer (``retry_backoff``: true means base 1)."""
    accepted = f"true, false, or an integer of at least {low}"

    def parse(raw: Any) -> bool | int:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str):
            word = raw.strip().lower()
            if word in _TRUE - {"1"}:
                return True
            if word in _FALSE - {"0"}:
                return False
            try:
                value = int(word)
            except ValueError:
                raise Invalid(f"expected {accepted}") from None
        else:
            raise Invalid(f"expected {accepted}")
        if value == 0:
            return False
        if value < low:
            raise Invalid(f"expected {accepted}")
        return value
    return ValueType(accepted, parse, toml_name="boolean or integer",
                     native=f"True, False, or an integer of at least {low}")


def integer(low: int, high: int | None = None) -> ValueType:
    accepted = (f"an integer from {low} to {high}" if high is not None
                else f"an integer of at least {low}")

    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or isinstance(raw, float):
            raise Invalid(f"expected {accepted}")
        if isinstance(raw, str):
            try:
                raw = int(raw.strip())
            except ValueError:
                raise Invalid(f"expected {accepted}") from None
        if not isinstance(raw, int):
            raise Invalid(f"expected {accepted}")
        if raw < low or (high is not None and raw > high):
            raise Invalid(f"expected {accepted}")
        return raw
    return ValueType(accepted, parse, toml_name="integer", native=accepted)


def seconds(*, positive: bool) -> ValueType:
    accepted = ("a number of seconds greater than 0" if positive
                else "a number of seconds, 0 or more")

    def parse(raw: Any) -> float:
        if isinstance(raw, bool):
            raise Invalid(f"expected {accepted}")
        if isinstance(raw, str):
            try:
                raw = float(raw.strip())
            except ValueError:
                raise Invalid(f"expected {accepted}") from None
        if not isinstance(raw, (int, float)) or raw != raw or raw in (float("inf"),):
            raise Invalid(f"expected {accepted}")
        if raw < 0 or (positive and raw == 0):
            raise Invalid(f"expected {accepted}")
        return float(raw)
    return ValueType(accepted, parse, toml_name="float", native=accepted)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3,
          "GB": 1000**3, "T": 1000**4, "TB": 1000**4, "KI": 1024, "KIB": 1024, "MI": 1024**2,
          "MIB": 1024**2, "GI": 1024**3, "GIB": 1024**3, "TI": 1024**4, "TIB": 1024**4}


def memory_size() -> ValueType:
    """An integer is KiB (Celery's worker_max_memory_per_child); strings may carry a unit."""
    accepted = ("a memory size: an integer number of KiB, or a number with a unit "
                "(512KiB, 200MiB, 1GiB; KB/MB/GB are powers of 1000)")

    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or isinstance(raw, float):
            raise Invalid(f"expected {accepted}")
        if isinstance(raw, int):
            if raw < 1:
                raise Invalid(f"expected {accepted}")
            return raw * 1024
        if isinstance(raw, str):
            match = _SIZE.match(raw)
            if match:
                number, unit = float(match.group(1)), (match.group(2) or "").upper()
                if not unit:
                    if number != int(number):
                        raise Invalid(f"expected {accepted}")
                    value = int(number) * 1024
                else:
                    value = int(number * _UNITS[unit])
                if value >= 1:
                    return value
        raise Invalid(f"expected {accepted}")
    return ValueType(accepted, parse, toml_name="integer or string")


def choice(*options: str) -> ValueType:
    """One of ``options``, in any case; given back as the option is written."""
    accepted = "one of " + ", ".join(options)
    by_key = {option.casefold(): option for option in options}

    def parse(raw: Any) -> str:
        if isinstance(raw, str) and raw.strip().casefold() in by_key:
            return by_key[raw.strip().casefold()]
        raise Invalid(f"expected {accepted}")
    return ValueType(accepted, parse)


def text(check: Callable[[str], str | None] | None = None,
         accepted: str = "a non-empty string") -> ValueType:
    """A string; ``check`` returns a complaint or None."""
    def parse(raw: Any) -> str:
        if not isinstance(raw, str) or not raw.strip():
            raise Invalid(f"expected {accepted}")
        value = raw.strip()
        complaint = check(value) if check else None
        if complaint:
            raise Invalid(complaint)
        return value
    return ValueType(accepted, parse)


def pool_bounds(low: int, high: int) -> ValueType:
    """Two pool sizes, in either order (``"2,8"``; Celery's ``--autoscale MAX,MIN`` is
    ``"8,2"``): the smaller is the least, the larger the most."""
    accepted = (f"two integers from {low} to {high}, the least and the most number of "
                "children (\"2,8\"; either order)")

    def parse(raw: Any) -> tuple[int, int]:
        if isinstance(raw, str):
            parts: list[Any] = [part.strip() for part in raw.split(",")]
        elif isinstance(raw, (list, tuple)):
            parts = list(raw)
        else:
            raise Invalid(f"expected {accepted}")
        if len(parts) != 2:
            raise Invalid(f"expected {accepted}")
        try:
            sizes = [integer(low, high).parse(part) for part in parts]
        except Invalid:
            raise Invalid(f"expected {accepted}") from None
        return min(sizes), max(sizes)
    return ValueType(accepted, parse, toml_name="string")


def string_list() -> ValueType:
    accepted = "a list of names (a TOML array, or comma-separated)"

    def parse(raw: Any) -> tuple[str, ...]:
        if isinstance(raw, str):
            items = [part.strip() for part in raw.split(",")]
        elif isinstance(raw, (list, tuple)) and all(isinstance(i, str) for i in raw):
            items = [i.strip() for i in raw]
        else:
            raise Invalid(f"expected {accepted}")
        if not items or any(not item for item in items):
            raise Invalid(f"expected {accepted}, none of them empty")
        if len(set(items)) != len(items):
            raise Invalid(f"expected {accepted}, without repeats")
        return tuple(items)
    return ValueType(accepted, parse, toml_name="array of strings")


def table() -> ValueType:
    """Options by name: a TOML table (``{ master_name = "mymaster" }``), or a JSON object
    as text (env, INI, command line)."""
    accepted = "a table of options (a TOML table, or a JSON object)"

    def parse(raw: Any) -> dict[str, Any]:
        value = raw
        if isinstance(raw, str):
            try:
                value = json.loads(raw)
            except ValueError as exc:
                raise Invalid(f"expected {accepted}: {exc}") from None
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise Invalid(f"expected {accepted}")
        return dict(value)
    return ValueType(accepted, parse, toml_name="table", native="a dict")


#: RabbitMQ's queue types a worker declares its task queues as (``queue_type``).
QUEUE_TYPES = ("classic", "quorum")


class QueueName(str):
    """A queue's name as ``queues`` lists it; ``queue_type`` is the type written beside it
    (``payments:quorum``), None where none is (the ``queue_type`` setting's then)."""

    queue_type: str | None = None


def queue_list() -> ValueType:
    accepted = ("a list of queue names, each optionally followed by :classic or :quorum "
                "(a TOML array, or comma-separated)")
    names = string_list()

    def parse(raw: Any) -> tuple[QueueName, ...]:
        try:
            items = names.parse(raw)
        except Invalid as exc:
            raise Invalid(str(exc).replace(names.accepted, accepted)) from None
        queues = []
        for item in items:
            name, colon, kind = item.rpartition(":")
            queue = QueueName(name if colon and name and kind.casefold() in QUEUE_TYPES
                              else item)
            if queue != item:
                queue.queue_type = kind.casefold()
            queues.append(queue)
        if len(set(queues)) != len(queues):
            raise Invalid(f"expected {accepted}, without repeats")
        return tuple(queues)
    return ValueType(accepted, parse, toml_name="array of strings")


def path(what: str = "a directory path") -> ValueType:
    accepted = f"{what} (relative paths are taken from the current directory)"

    def parse(raw: Any) -> Path:
        if isinstance(raw, Path):
            raw = str(raw)
        if not isinstance(raw, str) or not raw.strip():
            raise Invalid(f"expected {accepted}")
        return Path(raw.strip()).expanduser().absolute()
    return ValueType(accepted, parse)
