"""What changes a model's K/V besides its tokens: PEFT adapters.

The prefix cache is keyed by token ids; K/V computed under one adapter are wrong under
another. `WeightsKey(model)()` is a value that changes whenever the layers' adapters do:
which adapters are active, whether they are disabled or merged, their scalings, and
the version counters of their weights (torch bumps a tensor's `_version` on every
in-place write, so training steps and `load_state_dict` count). `ChunkCache` reads it
once per step and, when it changed, forgets every prefix it holds (`PrefixTree.forget_prefixes`):
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

    def __call__(self):
        configs = getattr(self.model, "peft_config", None)
        marker = (id(configs), tuple(configs) if isinstance(configs, dict) else None, "peft" in sys.modules)
        if marker != self._configs:
            self._configs, self._layers = marker, _adapter_layers(self.model)
        if not self._layers:
            return None
        return tuple(
            (tuple(layer.active_adapters), bool(layer.disable_adapters), bool(layer.merged),
             tuple(sorted(getattr(layer, "scaling", {}).items())),
             sum(p._version for p in layer.parameters()))
            for layer in self._layers
        )
