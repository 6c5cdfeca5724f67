"""`chunk-llama eval --constrained`: each answer decoded under a grammar of its app's tools.

The grammar is the answer format of the shipped set's worked examples, with the tool
call restricted to the app's own tools and each tool's number of arguments:

    Thought: <one line>
    Action: Tool[arg, arg]

The tools are read from the system prompt's tool list, lines `N. Tool[arg, arg]` (the
shipped set's `## Tools` section); a system prompt without one is a ValueError naming
its app. The Thought is at most 160 characters, an argument at most 80 characters of text
without brackets, commas or line breaks, so any model's answer ends. The output
ends after the call (the grammar is complete, only EOS is allowed), so the first tool
call after `Action:` is always well formed: what the grammar can fix is the format,
not the choice of tool or arguments.
"""

from __future__ import annotations

import json
import re

from chunk_llama.engine import Grammar

MAX_THOUGHT, MAX_ARGUMENT = 160, 80  # characters: every answer ends (the shipped examples' are under 60)
_TOOL_LINE = re.compile(r"^\s*\d+\.\s+([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]\n]*)\]", re.M)


def app_tools(system_prompt: str, app: str = "?") -> dict[str, int]:
    """The tools the system prompt lists, name -> number of arguments."""
    tools = {}
    for name, args in _TOOL_LINE.findall(system_prompt):
        tools.setdefault(name, len([a for a in args.split(",") if a.strip()]) or 1)
    if not tools:
        raise ValueError(f"app {app!r}: --constrained needs the system prompt to list its tools as "
                         "lines `1. ToolName[arg, arg]`; none found")
    return tools


def action_grammar(system_prompt: str, app: str = "?") -> Grammar:
    """The Lark grammar of one Thought line and one Action calling one of the app's tools."""
    separator = ' ", " '
    calls = [f'{json.dumps(name + "[")} {separator.join(["ARG"] * arity)} "]"'
             for name, arity in app_tools(system_prompt, app).items()]
    return Grammar.lark("start: \"Thought: \" LINE \"\\nAction: \" call\n"
                        f"call: {' | '.join(calls)}\n"
                        f"LINE: /[^\\n]{{1,{MAX_THOUGHT}}}/\n"
                        f"ARG: /[^\\[\\],\\n]{{1,{MAX_ARGUMENT}}}/\n")
