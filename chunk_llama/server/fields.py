"""Request fields this server does not know: accepted and ignored, as vLLM does (clients
send other servers' fields through `extra_body`), each name logged once (WARNING) and the
request's list in the `X-Chunk-Llama-Ignored-Fields` response header, so that a client can
see what had no effect. A malformed value of a known field is still a 400 (`schemas.py`).

Names are paths (`messages[].refusal`); the header lists at most `MAX_LISTED` of them, and
only names of printable ASCII (a name is the client's text: it must not break the header).
"""

from __future__ import annotations

import logging
import re

from pydantic import BaseModel

from chunk_llama.logs import log_once

logger = logging.getLogger("chunk_llama.server")

IGNORED_FIELDS_HEADER = "X-Chunk-Llama-Ignored-Fields"
MAX_LISTED = 32
MAX_LOGGED = 256  # distinct names logged in a process: a client sending random names cannot grow the log
_PRINTABLE = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,64}$")  # printable ASCII but the comma
_num_logged = 0  # distinct names logged so far


def unknown_fields(value, prefix: str = "") -> list[str]:
    """The paths of every field of a validated body (or a dict of one) that no model knows,
    sorted (elements of lists share one path: `tools[].function.x`)."""
    names: set[str] = set()
    _collect(value, prefix, names)
    return sorted(names)


def _collect(value, prefix: str, names: set[str]) -> None:
    if isinstance(value, BaseModel):
        names.update(prefix + str(k) for k in (value.model_extra or {}))
        for name in type(value).model_fields:
            _collect(getattr(value, name), f"{prefix}{name}.", names)
    elif isinstance(value, (list, tuple)):  # a dict field is data (a schema, kwargs), not fields
        for item in value:
            _collect(item, prefix[:-1] + "[].", names)


def ignored_fields_header(names: list[str]) -> dict[str, str]:
    """Log each new name once and return the response header listing them (empty: none)."""
    if not names:
        return {}
    global _num_logged
    for name in names:
        if _num_logged < MAX_LOGGED and log_once(logger, "ignored a request field unknown here: %r (logged once)",
                                                 name):
            _num_logged += 1
    listed = [n for n in names if _PRINTABLE.match(n)][:MAX_LISTED]
    rest = len(names) - len(listed)
    value = ", ".join(listed + ([f"({rest} more)"] if rest else []))
    return {IGNORED_FIELDS_HEADER: value}
