"""A decode step's forward as one traceable function: what `engine/graphs.py` compiles and
captures.

`decode_logits(model, input_ids, position_ids)` runs the modules `fused/decode_forward.py`
runs, in the same order (embedding, rotary embedding, Gemma 3's per layer type, each
decoder layer op by op, final norm, LM head on the last position, Gemma's soft-capping),
with two differences that make it traceable by `torch.compile(fullgraph=True)`:
- the layers get `PassThrough` as their cache (its `update` hands the new K/V on) and the
  keyword `chunk_llama_decode_op=True`, which transformers passes on to the attention
  function (`hf/attention.py`); there the attention is the custom op
  `chunk_llama::decode_attention` (`ops/attention_op.py`), which stores the K/V and attends on
  the current step when it runs: no tree, plan or ctypes call is traced;
- the patched linear layers and fused decoder layers run their own forward while traced
  (`torch.compiler.is_compiling()`: `hf/patch.py`, `fused/layers.py`), so the compiler sees
  plain torch ops.
Called eagerly it computes what the model's forward computes on the same step (tested).

`unsupported_reason(model)` says why a model cannot run it (then the engine's decode steps
run eager): the same conditions as the decode forward's (a plain-loop causal LM of a known
family with transformers' own forwards, no hooks, not training).
"""

from __future__ import annotations

import torch
from torch import nn

from chunk_llama.hf import compat
from chunk_llama.hf.attention import DECODE_OP
from chunk_llama.hf.families import CAUSAL_LMS, ROTARY_PER_LAYER_TYPE, SOFTCAPPED_LOGITS, STACK_MODELS
from chunk_llama.hf.fused.decode_forward import _plain
from chunk_llama.hf.fused.snapshot import GLOBAL_HOOKS


class PassThrough:
    """The cache a traced decode forward's layers see: `update` returns the new K/V as given
    (the attention op stores them into the step's slots)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states


_PASS_THROUGH = PassThrough()


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `decode_logits` cannot stand for this model's forward, or None."""
    inner = model.__dict__["_modules"].get("model")
    if not _plain(type(model), CAUSAL_LMS) or inner is None or not _plain(type(inner), STACK_MODELS):
        return (f"{type(model).__name__} is not a causal LM of a family whose forward is transformers' plain loop "
                f"({', '.join(sorted(CAUSAL_LMS))})")
    if model.training:
        return "the model is in training mode"
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked or any(GLOBAL_HOOKS):
        return "the model has forward hooks (a compiled step would run them once, at tracing)"
    return None


def decode_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  cache_argument: str | None = None) -> torch.Tensor:
    """input_ids, position_ids: [rows, 1] -> logits [rows, vocab] of a decode step (the rows
    the current step has first, padding rows after them). cache_argument: the layers' name of
    their cache keyword (`compat.cache_argument(model)`; pass it when tracing, which does not
    read signatures)."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)  # [rows, 1, hidden]
    layer_types = inner.config.layer_types if type(inner).__name__ in ROTARY_PER_LAYER_TYPE else None
    tables = {}  # layer type (None: the one rotary embedding) -> cos, sin [rows, 1, head_dim]

    def rotary(i: int) -> tuple:
        key = None if layer_types is None else layer_types[i]
        if key not in tables:
            tables[key] = inner.rotary_emb(hidden, position_ids) if key is None else inner.rotary_emb(
                hidden, position_ids, key)
        return tables[key]

    cache_argument = cache_argument or compat.cache_argument(model)
    layer_kwargs = {"attention_mask": None, "position_ids": position_ids, cache_argument: _PASS_THROUGH,
                    "use_cache": True, DECODE_OP: True}
    for i, layer in enumerate(list(inner.layers._modules.values())[: inner.config.num_hidden_layers]):
        hidden = layer(hidden, position_embeddings=rotary(i), **layer_kwargs)
    hidden = inner.norm(hidden)
    logits = model.lm_head(hidden[:, -1, :])  # [rows, vocab]
    cap = model.config.final_logit_softcapping if type(model).__name__ in SOFTCAPPED_LOGITS else None
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
