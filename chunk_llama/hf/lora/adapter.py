"""One LoRA adapter as the engine computes it: its factors per target linear layer, and its
identity.

The identity is what the prefix tree keys K/V by (`kv/tree.py`): a hash of the adapter's
factors (their bytes, shapes and dtypes) and scalings by target module, never its name, so
an adapter reloaded under the same name with other weights matches none of the old
adapter's chunks, and the same weights under two names share theirs.

`read_peft_dir` reads what PEFT's `save_pretrained` writes (`adapter_config.json` and
`adapter_model.safetensors`, or `.bin`), with each module's scaling as PEFT computes it:
`lora_alpha / r`, or `/ sqrt(r)` with `use_rslora`, per-module ranks and alphas from
`rank_pattern` and `alpha_pattern`. `check_against` says why an adapter does not fit a base
model (a target module it lacks, other sizes: an adapter for another base, a rank over the
limit), as a ValueError naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping

import torch

from chunk_llama.ops.lora import LoraFactors

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT options that change what a LoRA layer computes beyond base + s B A x: refused by name
UNSUPPORTED_OPTIONS = ("use_dora", "lora_bias", "use_qalora", "alora_invocation_tokens", "arrow_config",
                       "kasa_config", "velora_config", "monteclora_config", "use_bdlora", "megatron_config",
                       "layer_replication", "target_parameters", "trainable_token_indices", "modules_to_save")
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class LoraAdapter:
    """An adapter's factors by target module (its name in the base model, e.g.
    `model.layers.0.self_attn.q_proj`), each a tuple of `LoraFactors` (one; several for
    PEFT's active adapters combined), and its identity (module doc). `name` is how it was
    registered (the identity does not depend on it); `source` where it was read from."""

    def __init__(self, name: str, modules: Mapping[str, tuple[LoraFactors, ...]], source: str | None = None,
                 base_model: str | None = None):
        if not modules:
            raise ValueError(f"adapter {name!r} has no LoRA weights")
        self.name = name
        self.modules = dict(modules)
        self.source = source
        self.base_model = base_model
        self.identity = _identity(self.modules)
        self.rank = max(f.rank for factors in self.modules.values() for f in factors)
        self.targets = sorted({key.rpartition(".")[2] for key in self.modules})
        self.nbytes = sum(t.numel() * t.element_size() for factors in self.modules.values() for f in factors
                          for t in (f.a, f.b))

    def factors(self, module_key: str) -> tuple[LoraFactors, ...]:
        return self.modules.get(module_key, ())

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, rank {self.rank}, targets {self.targets}, {self.identity[:12]})"


def placed(adapter: LoraAdapter, devices: Mapping[str, torch.device]) -> LoraAdapter:
    """`adapter` with each module's factors on that module's device (`devices`), itself where
    they are already."""
    if all(f.a.device == devices[key] for key, factors in adapter.modules.items() for f in factors):
        return adapter
    modules = {key: tuple(LoraFactors(f.a.to(devices[key]), f.b.to(devices[key]), f.scaling) for f in factors)
               for key, factors in adapter.modules.items()}
    return LoraAdapter(adapter.name, modules, adapter.source, adapter.base_model)


def combined(name: str, adapters: list[LoraAdapter]) -> LoraAdapter:
    """Several adapters applied together (PEFT's active adapters summed), as one."""
    modules: dict[str, tuple[LoraFactors, ...]] = {}
    for adapter in adapters:
        for key, factors in adapter.modules.items():
            modules[key] = modules.get(key, ()) + factors
    return LoraAdapter(name, modules)


def _identity(modules: Mapping[str, tuple[LoraFactors, ...]]) -> str:
    digest = hashlib.blake2b(digest_size=20)
    for key in sorted(modules):
        digest.update(key.encode())
        for f in modules[key]:
            digest.update(repr(float(f.scaling)).encode())
            for tensor in (f.a, f.b):
                digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
                digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def scaling(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) for rank-stabilised LoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _pattern(patterns: Mapping[str, float], module: str, default: float) -> float:
    """A per-module value of `rank_pattern` / `alpha_pattern`, matched as PEFT matches it (a
    key is the module's name or its dotted suffix, as a regular expression)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft_dir(name: str, path: str, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter PEFT saved in the folder `path` (ValueError naming what is missing or not
    supported). Its factors are kept in `dtype` where the file holds another floating type."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"adapter {name!r}: {path} has no {CONFIG_FILE} (a folder PEFT's save_pretrained wrote)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r} is a {config.get('peft_type')} adapter; only LoRA runs per request")
    for option in UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise ValueError(f"adapter {name!r} sets {option}={config[option]!r}, which per-request LoRA does not "
                             "support")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r} trains biases (bias={config['bias']!r}); per-request LoRA does not "
                         "support it")
    state = _read_weights(name, path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if match is None:
            raise ValueError(f"adapter {name!r} holds {key}, which is not a LoRA factor (lora_A or lora_B weight)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: {module} has lora_{''.join(pair)} without its other factor")
        a, b = (pair[w].to(dtype) if pair[w].is_floating_point() else pair[w] for w in ("A", "B"))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter {name!r}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                             "not the factors of one rank")
        rank = int(_pattern(config.get("rank_pattern") or {}, module, config.get("r", a.shape[0])))
        if rank != a.shape[0]:
            raise ValueError(f"adapter {name!r}: {module} has rank {a.shape[0]} but its config says {rank}")
        alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        modules[module] = (LoraFactors(a.contiguous(), b.contiguous(),
                                       scaling(alpha, rank, bool(config.get("use_rslora")))),)
    return LoraAdapter(name, modules, source=os.path.abspath(path), base_model=config.get("base_model_name_or_path"))


def _read_weights(name: str, path: str) -> dict[str, torch.Tensor]:
    for file in WEIGHT_FILES:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(full, device="cpu")
        return torch.load(full, map_location="cpu", weights_only=True)
    raise ValueError(f"adapter {name!r}: {path} has none of {', '.join(WEIGHT_FILES)}")


def check_against(adapter: LoraAdapter, linears: Mapping[str, tuple], max_rank: int | None,
                  base_name: str | None = None) -> None:
    """ValueError naming why `adapter` cannot run on a base whose LoRA-able linear layers are
    `linears` (module name -> (in_features, out_features, ...)): a rank over `max_rank`, a target
    module the base does not have, or factors of other sizes (an adapter for another base)."""
    if max_rank is not None and adapter.rank > max_rank:
        raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over the limit of {max_rank} "
                         "(--max-lora-rank)")
    for module, factors in adapter.modules.items():
        if module not in linears:
            raise ValueError(f"adapter {adapter.name!r} targets {module}, a module the base model does not have "
                             "(or not a linear layer of its decoder layers)")
        in_features, out_features = linears[module][:2]
        for f in factors:
            if f.a.shape[1] != in_features or f.b.shape[0] != out_features:
                made_for = f" (made for {adapter.base_model})" if adapter.base_model else ""
                raise ValueError(
                    f"adapter {adapter.name!r} is for another base model{made_for}: its {module} maps "
                    f"{f.a.shape[1]} -> {f.b.shape[0]} features, the base's {in_features} -> {out_features}"
                    + (f" ({base_name})" if base_name else ""))
