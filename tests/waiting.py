"""Waiting in tests for what another process does (a server starting, a job ending): one polling helper."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(condition: Callable[[], object], seconds: float, step: float = 0.05) -> bool:
    """Whether `condition()` became true within `seconds`, asked every `step` seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return False
