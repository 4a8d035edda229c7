"""Structured, quiet-by-default logging: one ``event key=value ...`` line each."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# The name of the stderr handler ``setup`` adds: one per process, whoever else handles these records.
HANDLER_NAME = "spec_serve.stderr"


def setup(level: str | int | None = None) -> None:
    """Configure the root spec_serve logger once (WARNING unless told otherwise)."""
    level = level or os.environ.get("SPEC_SERVE_LOG_LEVEL", "WARNING")
    root = logging.getLogger("spec_serve")
    if not any(h.get_name() == HANDLER_NAME for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(HANDLER_NAME)
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level.upper() if isinstance(level, str) else level)


def event(logger: logging.Logger, level: int, name: str, **fields) -> None:
    """Log ``name k=v ...``; values are rendered with repr only when they hold spaces."""
    if not logger.isEnabledFor(level):
        return
    parts = [name]
    for k, v in fields.items():
        s = str(v)
        parts.append(f"{k}={s!r}" if (" " in s or not s) else f"{k}={s}")
    logger.log(level, " ".join(parts))


def quiet_transformers() -> None:
    """Weight-loading (and hub download) progress bars from transformers only where someone watches:
    on a terminal, or when logging at DEBUG; never into a log file."""
    watched = sys.stderr.isatty() or logging.getLogger("spec_serve").getEffectiveLevel() <= logging.DEBUG
    if not watched:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (engines' messages often span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")


class Throttle:
    """At most one log line per ``interval`` seconds per key; counts the lines it held back. Keys whose
    window has passed are forgotten once there are ``MAX_KEYS`` (a key per peer address stays bounded)."""

    MAX_KEYS = 4096

    def __init__(self, interval: float):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def ready(self, key: str, now: float) -> int | None:
        """None: stay quiet; else log now, and the number returned were held back since the last line."""
        if now - self._last.get(key, float("-inf")) < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._last) >= self.MAX_KEYS:
            for stale in [k for k, last in self._last.items() if now - last >= self.interval]:
                del self._last[stale]
        self._last[key] = now
        return self._held.pop(key, 0)
