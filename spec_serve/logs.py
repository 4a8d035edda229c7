"""Structured, quiet-by-default logging: one ``event key=value ...`` line each."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def setup(level: str | int | None = None) -> None:
    """Configure the root spec_serve logger once (WARNING unless told otherwise)."""
    level = level or os.environ.get("SPEC_SERVE_LOG_LEVEL", "WARNING")
    root = logging.getLogger("spec_serve")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
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
    """No weight-loading progress bars from transformers unless logging at DEBUG."""
    if logging.getLogger("spec_serve").getEffectiveLevel() > logging.DEBUG:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (engines' messages often span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")
