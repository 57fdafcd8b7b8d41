"""The app and settings in force, shared by the supervisor's parts and replaced as a whole
by a reload (SIGHUP): each part reads them from here, so none keeps a stale copy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..app import App
    from ..config import Settings


@dataclass
class Current:
    app: App
    settings: Settings
