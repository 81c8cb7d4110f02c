"""ckpt's logger, ``logging.getLogger("ckpt")``.

Messages carry no ``ckpt:`` prefix of their own: a configured handler's format names the logger
already (``WARNING:ckpt:…`` under ``logging.basicConfig``). Where nothing is configured, Python's
last-resort handler prints a warning's bare message; then this filter puts ckpt's name in front of
it, so the line still says whose it is.
"""

from __future__ import annotations

import logging

log = logging.getLogger("ckpt")


class _NameWhenUnconfigured(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not log.hasHandlers() and isinstance(record.msg, str) and not record.msg.startswith("ckpt: "):
            record.msg = "ckpt: " + record.msg
        return True


if not any(isinstance(f, _NameWhenUnconfigured) for f in log.filters):  # once, even if this module is reloaded
    log.addFilter(_NameWhenUnconfigured())
