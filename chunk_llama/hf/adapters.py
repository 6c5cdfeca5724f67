"""What changes a model's K/V besides its tokens: PEFT adapters applied to every row.

The prefix cache is keyed by token ids (and, where the engine assigns adapters per request,
by the adapter's identity: `hf/lora/`); K/V computed under one adapter state are wrong
under another. Where PEFT's own forward applies its active adapters to every row (stock
`generate` on a patched PeftModel, or an engine on a model whose tuner layers it cannot add
per row), `WeightsKey(model)()` is a value that changes whenever the layers' adapters do:
which adapters are active, whether they are disabled or merged, their scalings, which
tensors hold their weights and the version counters of those (torch bumps a tensor's
`_version` on every in-place write, so training steps and `load_state_dict` count; an
adapter deleted and loaded again under its name has new tensors whose counters start
again, so the tensors themselves are compared: the key holds them, so none can be freed
and another made at its address while it is compared). `ChunkCache` reads it once per step
and, when it changed, forgets every prefix it holds (`PrefixTree.forget_prefixes`):
retained chunks are freed and no later request matches K/V of the old weights.

A model without PEFT layers has a constant key and pays one attribute check per step.
Other in-place changes of the base weights are not tracked: call `ChunkCache.reset()`
(or `engine.cache.reset()`) after them.
"""

from __future__ import annotations

import sys

import torch


def _adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's tuner layers (LoRA and the others: `peft.tuners.tuners_utils.BaseTunerLayer`)."""
    if "peft" not in sys.modules:  # no adapter can exist without the library
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class WeightsKey:
    """A hashable value of the model's adapter state; the list of adapter layers is found
    again when the model's PEFT configs change (an adapter added or deleted)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._configs = None
        self._layers: list[torch.nn.Module] = []
        self._held: tuple = ()  # the adapter tensors the last key was read from

    def __call__(self):
        configs = getattr(self.model, "peft_config", None)
        marker = (id(configs), tuple(configs) if isinstance(configs, dict) else None, "peft" in sys.modules)
        if marker != self._configs:
            self._configs, self._layers = marker, _adapter_layers(self.model)
        if not self._layers:
            return None
        held = tuple(tuple(layer.parameters()) for layer in self._layers)
        key = tuple(
            (tuple(layer.active_adapters), bool(layer.disable_adapters), bool(layer.merged),
             tuple(sorted(getattr(layer, "scaling", {}).items())),
             tuple(map(id, params)), sum(p._version for p in params))
            for layer, params in zip(self._layers, held)
        )
        self._held = held  # (released at the next call, after the next key was read)
        return key
