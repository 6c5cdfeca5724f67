"""Scoring a model's output against a gold tool call such as `FlightStatus[DL 1182, 2022-03-14]`."""

from __future__ import annotations

import re

_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\[([^\[\]]*)\]")


def normalize_call(call: str) -> str:
    """`Tool[ a ,  "b" ]` -> `tool[a, b]`: case, spacing and quotes do not count."""
    match = _CALL.search(call)
    if match is None:
        return " ".join(call.lower().split())
    args = [" ".join(a.strip().strip("'\"").split()) for a in match.group(2).split(",")]
    return f"{match.group(1).lower()}[{', '.join(a.lower() for a in args if a)}]"


def extract_tool_call(output: str) -> str | None:
    """The first tool call in a model's output (after `Action:` when there is one), or None."""
    action = output.find("Action:")
    match = _CALL.search(output[action:] if action >= 0 else output)
    return match.group(0) if match else None


def is_correct(output: str, answer: str) -> bool:
    """Exact match of the normalized first tool call with the normalized gold answer."""
    call = extract_tool_call(output)
    return call is not None and normalize_call(call) == normalize_call(answer)
