"""`log_once`: a message said once per process, for the fallbacks to slower paths (never
silent, never repeated every step) and the warnings about a model or tokenizer."""

from __future__ import annotations

import logging
import threading

_said: set[tuple[str, str]] = set()
_lock = threading.Lock()


def log_once(logger: logging.Logger, message: str, *args, level: int = logging.WARNING) -> bool:
    """Log `message % args` on `logger` at `level` unless this logger said that text before
    in this process; returns whether it logged."""
    text = message % args if args else message
    with _lock:
        if (logger.name, text) in _said:
            return False
        _said.add((logger.name, text))
    logger.log(level, "%s", text)
    return True


def forget_logged() -> None:
    """Say everything again once (tests that check a message)."""
    with _lock:
        _said.clear()
