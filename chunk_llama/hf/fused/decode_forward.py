"""An engine decode step's forward of a plain-loop causal LM, without transformers' wrappers.

With the decoder stack in one C call (`stack.py`), what is left of a batch-1 decode
step in Python is mostly transformers' forward around it: the output-capture and
config-default decorators, the mask, and 29 layer calls that only pass the stack's output
on (about 0.5 ms a step of the default model, a twentieth of it). For the causal LMs whose
forward is that plain loop (`CAUSAL_LMS`, each with a `STACK_MODELS` body, both as
transformers defines them), an engine decode step runs the same modules in the same order
itself: the embedding, the rotary embedding (Gemma 3's per layer type, each computed
where a layer first needs it: the stack computes the other types' itself), the first
decoder layer (whose call runs the stack), the others only if the stack did not apply,
the final norm, the LM head on the last position and Gemma's logit soft-capping where
the config sets one. The mask is the one a forward on a `ChunkCache` gets anyway (None:
the tree implies it), so the result is the forward's, bit for bit (tested against it per
family).

It does not apply, and transformers' forward runs, where a hook would be skipped (on the
model or its decoder stack, or a global one), in training, under autograd, where the
classes' forwards are not transformers' own (a subclass, or a library that replaced them),
for forward arguments other than the engine's, or with `CHUNK_LLAMA_DECODE_FORWARD=0`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from chunk_llama.hf import compat
from chunk_llama.hf.families import CAUSAL_LMS, ROTARY_PER_LAYER_TYPE, SOFTCAPPED_LOGITS, STACK_MODELS
from chunk_llama.hf.fused import per_step
from chunk_llama.hf.fused.snapshot import GLOBAL_HOOKS
from chunk_llama.ops.build.jit import setting

ENV = "CHUNK_LLAMA_DECODE_FORWARD"
_ARGUMENTS = frozenset({"input_ids", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values",
                        "attention_mask"})


def applies(forward, kwargs: dict) -> bool:
    """Whether this forward (of the engine's decode step: `forward`, the model's forward the
    patch wraps, called with `kwargs`) may run as `run` does: checked at every call (a few
    attribute reads)."""
    model = getattr(forward, "__self__", None)
    if model is None or getattr(forward, "__func__", None) is not type(model).forward:
        return False  # (a forward the model's class does not define: a wrapper of it may do more)
    inner = model.__dict__["_modules"].get("model")
    return (_plain(type(model), CAUSAL_LMS) and inner is not None and _plain(type(inner), STACK_MODELS)
            and kwargs.keys() <= _ARGUMENTS and kwargs.get("attention_mask") is None
            and kwargs.get("use_cache", True) and kwargs.get("logits_to_keep") == 1
            and kwargs.get("input_ids") is not None and kwargs.get("position_ids") is not None
            and not (model.training or torch.is_grad_enabled() or "forward" in inner.__dict__
                     or model._forward_hooks or model._forward_pre_hooks or inner._forward_hooks
                     or inner._forward_pre_hooks or any(GLOBAL_HOOKS))
            and setting(ENV, "1") != "0")


def _plain(cls: type, names: frozenset) -> bool:
    """A transformers class named in `names` whose forward is the one its modeling file defines."""
    return cls.__name__ in names and cls.__module__.startswith("transformers.") and \
        cls.forward.__module__ == cls.__module__


def run(model: nn.Module, step, kwargs: dict) -> CausalLMOutputWithPast:
    """The decode step's forward (`applies` held): input_ids, position_ids [rows, 1] ->
    logits [rows, 1, vocab] as transformers' forward gives them."""
    return CausalLMOutputWithPast(logits=logits(model, step, kwargs))


def logits(model: nn.Module, step, kwargs: dict) -> torch.Tensor:
    """`run`'s logits [rows, 1, vocab], without the output object (`patch.decode_logits`)."""
    inner = model.model
    cache_argument = compat.cache_argument(model)
    input_ids, position_ids = kwargs["input_ids"], kwargs["position_ids"]
    hidden = inner.embed_tokens(input_ids)  # [rows, 1, hidden]
    layer_types = inner.config.layer_types if type(inner).__name__ in ROTARY_PER_LAYER_TYPE else None
    tables = {}  # layer type (None: the one rotary embedding) -> cos, sin [rows, 1, head_dim]

    def rotary(i: int) -> tuple:
        key = None if layer_types is None else layer_types[i]
        if key not in tables:  # (from the embedding's output, as the forward computes them: only its dtype counts)
            tables[key] = inner.rotary_emb(hidden, position_ids) if key is None else inner.rotary_emb(
                hidden, position_ids, key)
        return tables[key]

    layer_kwargs = {"attention_mask": None, "position_embeddings": rotary(0), "position_ids": position_ids,
                    # (the cache under the name the caller used: a PeftModel's forward takes `past_key_values`
                    # and passes it on as given, where this model's layers may take `cache`)
                    cache_argument: compat.cache_from(kwargs), "use_cache": True}
    layers = list(inner.layers._modules.values())[: inner.config.num_hidden_layers]  # (a ModuleList slice builds one)
    hidden = layers[0](hidden, **layer_kwargs)
    ran = per_step.stack_output(step)  # (its Stack, its output) when layer 0's call ran every layer
    stacked = ran is not None and ran[1] is hidden
    if not stacked:
        for i, layer in enumerate(layers[1:], 1):
            layer_kwargs["position_embeddings"] = rotary(i)
            hidden = layer(hidden, **layer_kwargs)
    hidden = inner.norm(hidden)
    logits = model.lm_head(hidden[:, -1:, :])
    if stacked:  # (the head read the step's last weights: what the next step's checks read is evicted)
        ran[0].warm(step.attention)
    cap = model.config.final_logit_softcapping if type(model).__name__ in SOFTCAPPED_LOGITS else None
    if cap is not None:  # (in its forward's operations)
        logits = torch.tanh(logits / cap) * cap
    return logits
