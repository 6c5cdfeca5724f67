"""One forward step: its plans (decode, prefill, for every device) and its context.

Below the kernels (`ops/`) and above the storage (`kv/`): the plans flatten the tree
into the index arrays the kernels read, and `StepContext` carries everything one
forward's layers read, built complete by `StepBuilder` and then frozen.
"""

from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.builder import StepBackends, StepBuilder
from chunk_llama.step.context import StepContext, StepWrites, current_step, running
from chunk_llama.step.decode_plan import NO_POSITION, DecodePlan, build_decode_plan
from chunk_llama.step.prefill_plan import PrefillPlan, build_prefill_plan

__all__ = ["NO_POSITION", "DecodePlan", "PrefillPlan", "StaticBuffers", "StepBackends", "StepBuilder", "StepContext",
           "StepWrites", "build_decode_plan", "build_prefill_plan", "current_step", "running"]
