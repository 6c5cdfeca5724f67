"""The adapters of a PEFT `PeftModel` handed to the engine as it is, read from its LoRA layers.

Each adapter PEFT holds (`peft_config`'s names) is a `LoraAdapter` whose factors are PEFT's
own `lora_A` / `lora_B` weights (no copy) with PEFT's scalings. What the model computes as
it stands (its active adapters, none where they are disabled) is one too, or the base.

PEFT changes adapters in place: `delete_adapter` then `load_adapter` under the same name
makes new tensors, training writes into the old ones, `set_adapter` and `disable_adapter`
change which apply, `merge_adapter` writes them into the base weights. `PeftAdapters.get`
compares what an adapter was read from (the tensor objects, held here, so no other tensor
can take their place in memory, their version counters, the scalings) with what the layers
hold now, and reads the adapter again where they differ: its identity is then a new
hash, never the old one. Tensors written in place (`changed_in_place`) made K/V under the
old identity that no weights compute any more: the caller forgets them. `base_state`
changes when the base weights do (a merge): the caller forgets everything.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from chunk_llama.hf.lora.adapter import LoraAdapter, combined
from chunk_llama.ops.lora import LoraFactors


def peft_inner(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (`base_model.model`), or `model` itself."""
    if "peft" not in sys.modules:
        return model
    from peft import PeftModel

    return model.base_model.model if isinstance(model, PeftModel) else model


def tuner_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's tuner layers of the model (LoRA and the others), by module name."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: m for name, m in peft_inner(model).named_modules() if isinstance(m, BaseTunerLayer)}


def unsupported_reason(layers: dict[str, nn.Module], name: str | None = None) -> str | None:
    """Why the engine cannot add these layers' LoRA (of adapter `name`, or of any) per request
    row itself, or None: it adds plain LoRA on linear layers only."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module_name, layer in layers.items():
        if type(layer) is not LoraLinear:
            return f"{module_name} is a {type(layer).__module__}.{type(layer).__name__}, not a LoRA linear layer"
        names = [name] if name is not None else list(layer.lora_A)
        for adapter in names:
            if adapter in layer.lora_variant or layer.use_dora.get(adapter) or layer.lora_bias.get(adapter):
                return f"adapter {adapter!r} on {module_name} is a LoRA variant (DoRA, a LoRA bias...)"
    return None


class PeftAdapters:
    """The `LoraAdapter`s of one PeftModel, read again when PEFT changed them (module doc)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._read: dict[str, tuple[LoraAdapter, tuple, tuple]] = {}  # name -> (adapter, tensors, versions)
        self._layers: dict[str, nn.Module] | None = None
        self._layers_for = None
        self.generation = 0  # bumped each time the layers are found again

    def layers(self) -> dict[str, nn.Module]:
        """The LoRA layers by module name, found again when PEFT's configs change."""
        configs = getattr(self.model, "peft_config", None)
        marker = (id(configs), tuple(configs) if isinstance(configs, dict) else None)
        if self._layers is None or marker != self._layers_for:
            self._layers, self._layers_for = tuner_layers(self.model), marker
            self.generation += 1
        return self._layers

    def read_adapters(self) -> dict[str, tuple]:
        """name -> (adapter, tensors, versions) as last read (`get`)."""
        return dict(self._read)

    def names(self) -> list[str]:
        configs = getattr(self.model, "peft_config", None)
        return list(configs) if isinstance(configs, dict) else []

    def get(self, name: str) -> tuple[LoraAdapter, LoraAdapter | None]:
        """(adapter `name` as PEFT holds it now, the adapter read before if its tensors were
        written in place since: its K/V are to be forgotten). ValueError if PEFT has no such
        adapter or one the engine cannot add per row."""
        layers = self.layers()
        if name not in self.names():
            raise ValueError(f"unknown adapter {name!r}; the PeftModel has {self.names()}")
        reason = unsupported_reason(layers, name)
        if reason is not None:
            raise ValueError(f"adapter {name!r} cannot run per request: {reason}")
        holding = {key: layer for key, layer in layers.items() if name in layer.lora_A}
        tensors = tuple(t for layer in holding.values()
                        for t in (layer.lora_A[name].weight, layer.lora_B[name].weight))
        versions = tuple(t._version for t in tensors) + tuple(float(layer.scaling[name]) for layer in holding.values())
        read = self._read.get(name)
        if read is not None and len(read[1]) == len(tensors) and all(map(_same, read[1], tensors)) \
                and read[2] == versions:
            return read[0], None
        in_place = read if read is not None and len(read[1]) == len(tensors) and all(map(_same, read[1], tensors)) \
            else None
        adapter = LoraAdapter(name, {key: (LoraFactors(layer.lora_A[name].weight.detach(),
                                                       layer.lora_B[name].weight.detach(),
                                                       float(layer.scaling[name])),)
                                     for key, layer in holding.items()}, source="peft")
        self._read[name] = (adapter, tensors, versions)
        return adapter, (in_place[0] if in_place is not None else None)

    def as_it_stands(self) -> tuple[LoraAdapter | None, list[LoraAdapter]]:
        """(what the model computes now: its active adapters combined, or None for the base
        where none is active or they are disabled; adapters changed in place since read)."""
        layers = self.layers()
        if not layers or any(layer.disable_adapters for layer in layers.values()):
            return None, []
        active = list(dict.fromkeys(a for layer in layers.values() for a in layer.active_adapters))
        if any(layer.merged for layer in layers.values()):
            return None, []  # (merged into the base weights: `base_state` changed)
        read = [self.get(name) for name in active if name in self.names()]
        stale = [old for _, old in read if old is not None]
        adapters = [adapter for adapter, _ in read]
        if not adapters:
            return None, stale
        return (adapters[0] if len(adapters) == 1 else combined("+".join(active), adapters)), stale

    def base_state(self) -> tuple:
        """What changes when PEFT writes adapters into the base weights: which are merged, and
        the base layers' weight tensors and versions."""
        layers = self.layers()
        merged = tuple(tuple(layer.merged_adapters) for layer in layers.values())
        weights = [getattr(layer.get_base_layer(), "weight", None) for layer in layers.values()]
        return merged, tuple((id(w), w._version) if isinstance(w, torch.Tensor) else None for w in weights)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b
