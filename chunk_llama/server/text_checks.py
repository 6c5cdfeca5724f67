"""Strings a request may not hold: a lone surrogate.

JSON may escape a UTF-16 surrogate half alone (`"hi \\ud83d"`); `json.loads` turns it into a
Python string holding that half, which is not Unicode text: the tokenizer refuses it with an
internal error, and an answer quoting it cannot be encoded as UTF-8. A pair of halves
(`"\\ud83c\\udf89"`) is joined by the parser into one character, so any surrogate left in a
parsed string is lone. The request schemas (`schemas.py`) refuse such a string with a 400
naming its field, its place and the half (`contains a lone surrogate (\\ud83d) at character 3`).
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value, where: str = "") -> str | None:
    """What is wrong with the first lone surrogate in `value` (a string, or one inside its
    lists and dicts, keys included), or None. `where`: the path of `value` inside its
    field (empty: the field itself). Parts that are models validate themselves."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        if match is None:
            return None
        return (f"{where + ' ' if where else ''}contains a lone surrogate (\\u{ord(match.group()):04x}) at character "
                f"{match.start()}; JSON text must escape whole characters (a surrogate pair), not half of one")
    if isinstance(value, (list, tuple)):
        return next((found for i, item in enumerate(value) if (found := lone_surrogate(item, f"{where}[{i}]"))), None)
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            found = lone_surrogate(key, f"{where} key" if where else "a key") or lone_surrogate(item, path)
            if found is not None:
                return found
    return None
