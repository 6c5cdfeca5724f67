"""What the fused decoder layers work out once per step, kept with them, not on the step.

The step context is frozen once built (`step/context.py`); the fused layers still have
things to remember within a step: why its layers run op by op (or None: they may fuse),
read at its first layer, the output of the decoder stack once layer 0's call ran every
layer (the later layers pass it on; `decode_forward.py` skips them), and its rows under
LoRA adapters as the C calls take them. All are keyed by the step: a later step (or
another thread's) starts afresh, and the state goes with its step.
"""

from __future__ import annotations

import weakref

_UNREAD = object()


class FusedStep:
    """reason: why the step's layers run op by op, None where they may fuse, or unread;
    stack_output: (the Stack, its output) once a plain-loop stack ran in one call, else None;
    lora: the step's rows under adapters per run of layers (`lora.py`), made at first use."""

    __slots__ = ("reason", "stack_output", "lora")

    def __init__(self):
        self.reason = _UNREAD
        self.stack_output: tuple | None = None
        self.lora: dict = {}  # id(scope) -> (scope, its rows under adapters: `lora.py`)

    @property
    def reason_read(self) -> bool:
        return self.reason is not _UNREAD


_states: "weakref.WeakKeyDictionary[object, FusedStep]" = weakref.WeakKeyDictionary()


def of(step) -> FusedStep:
    """The fused layers' state for `step` (made at its first layer; gone with the step)."""
    state = _states.get(step)
    if state is None:
        state = _states[step] = FusedStep()
    return state


def stack_output(step) -> tuple | None:
    """(Stack, output) when the step's decoder stack ran in one call, else None."""
    state = _states.get(step)
    return None if state is None else state.stack_output
