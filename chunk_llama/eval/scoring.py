"""Scoring a model's output against a gold tool call such as `FlightStatus[DL 1182, 2022-03-14]`.

Correct means: the output's first tool call (the first `Tool[args]` after its first
`Action:`, or `Action 1:`; anywhere when it has no Action line) names the gold tool
and gives the gold arguments in the gold order. Only letter case, whitespace and
quotes around an argument do not count; a truncated call, another tool, an extra,
missing or reordered argument, or a call in a Thought before the Action are wrong.
"""

from __future__ import annotations

import re

_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\[([^\[\]]*)\]")
_OPEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\[")
_ACTION = re.compile(r"Action(?:\s*\d+)?\s*:")


def normalize_call(call: str) -> str:
    """`Tool[ a ,  "b" ]` -> `tool[a, b]`: case, spacing and quotes do not count."""
    match = _CALL.fullmatch(call.strip())
    if match is None:  # not a flat call (nested brackets): compared as text
        return " ".join(call.lower().split())
    args = [" ".join(a.strip().strip("'\"").split()) for a in match.group(2).split(",")]
    return f"{match.group(1).lower()}[{', '.join(a.lower() for a in args if a)}]"


def extract_tool_call(output: str) -> str | None:
    """The first tool call in a model's output (after `Action:` when there is one), its
    brackets balanced (`Finish[f[x]]` is one call), or None (no call, or one cut off)."""
    action = _ACTION.search(output)
    text = output[action.end():] if action else output
    start = _OPEN.search(text)
    if start is None:
        return None
    depth = 0
    for i in range(start.end() - 1, len(text)):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return text[start.start():i + 1]
    return None


def is_correct(output: str, answer: str) -> bool:
    """Exact match of the normalized first tool call with the normalized gold answer."""
    call = extract_tool_call(output)
    return call is not None and normalize_call(call) == normalize_call(answer)
