"""Where the filter's own faults go, for the site's administrator: the filter runs inside sbatch as the submitting
user with its stderr on /dev/null, and fails open, so without this a broken install (an unreadable config, a bug of
ours) is seen by nobody. `[filter] log` in the site config: "syslog" (the default: the local syslog daemon through
/dev/log, facility user, tag xmem-slurm, where journald and rsyslog keep it), an absolute path of a file every
user can append to, or "none". A file that cannot be opened falls back to syslog. Never raises: the submission
goes on whatever happens here. `logging` is imported only when there is a fault: the filter's cached path stays
as fast as it was (logging.handlers alone costs 30 ms).
"""

from __future__ import annotations

import os
from typing import Any

SYSLOG = "syslog"
NONE = "none"
SYSLOG_ADDRESS = "/dev/log"
TAG = "xmem-slurm"


def log_fault(message: str, destination: str = SYSLOG) -> bool:
    """Log one line of the filter's own fault where the site said; whether it was written."""
    try:
        import logging

        handler = _handler(destination, SYSLOG_ADDRESS)
        if handler is None:
            return False
        logger = logging.Logger(TAG)  # our own, unregistered: the process's logging setup is not touched
        logger.addHandler(handler)
        try:
            logger.error("%s", " ".join(message.split()))  # one line, whatever the exception held
        finally:
            handler.close()
        return True
    except Exception:  # noqa: BLE001 - logging must never be what fails a submission
        return False


def _handler(destination: str, syslog_address: str) -> Any:
    """A logging.Handler for `destination`, or None where there is nowhere to write."""
    import logging
    import logging.handlers

    if destination == NONE:
        return None
    if destination != SYSLOG:
        try:
            handler = logging.FileHandler(destination, encoding="utf-8", delay=False)
            handler.setFormatter(logging.Formatter(f"%(asctime)s {TAG}[%(process)d] uid={os.getuid()}: %(message)s"))
            return handler
        except OSError:
            pass  # not writable by this user: the admin still hears of it through syslog
    if not os.path.exists(syslog_address):
        return None
    handler = logging.handlers.SysLogHandler(address=syslog_address, facility=logging.handlers.SysLogHandler.LOG_USER)
    handler.setFormatter(logging.Formatter(f"{TAG}[%(process)d]: uid={os.getuid()}: %(message)s"))
    return handler


__all__ = ["NONE", "SYSLOG", "SYSLOG_ADDRESS", "log_fault"]
