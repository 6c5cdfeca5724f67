"""The engine's LoRA adapters (`EngineAdapters`, a mixin of `ChunkLlamaEngine`): loading and
unloading them by name while it runs, and what each request runs under.

Requests under different adapters, and under the base, run in the same steps: each linear
layer computes its base product once for all rows and adds each adapter's delta to its
rows (`ops/lora.py`). What a request's prefix cache holds is keyed by the adapter's
identity (a hash of its weights), so a reload under the same name with other weights never
reads the old one's K/V. The registry (`hf/lora/registry.py`) says which adapters are known
and resident.
"""

from __future__ import annotations

from chunk_llama.hf.lora.registry import AdapterRegistry


class EngineAdapters:
    """Adapters by name for `ChunkLlamaEngine` (which sets `cache`, `_stepping`)."""

    adapters: AdapterRegistry

    def _load_adapters(self, lora_modules: dict[str, str] | None) -> None:
        if lora_modules is not None and not isinstance(lora_modules, dict):
            raise TypeError(f"lora_modules must be a dict of name -> adapter folder, got {type(lora_modules).__name__}")
        for name, path in (lora_modules or {}).items():
            self.adapters.load(name, path)

    def load_adapter(self, name: str, path: str) -> dict:
        """Load the LoRA adapter PEFT saved in the folder `path` as `name` (thread-safe; a
        loaded one of that name is replaced: requests already submitted under it finish with
        it, later ones run the new one, and its cached prefixes are freed). Returns its
        description (`adapter_names`). ValueError naming what does not fit: an adapter for
        another base, a target module the base lacks, a rank over `max_lora_rank`, a
        LoRA variant this engine does not compute (DoRA...)."""
        self._check_open()
        adapter, replaced = self.adapters.load(name, path)
        if replaced is not None:
            with self._stepping():
                self.cache.tree.evict_key(replaced)
        return next(d for d in self.adapters.describe() if d["name"] == name) | {"rank": adapter.rank}

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter loaded as `name` (thread-safe): requests submitted under it
        finish with it; its cached prefixes are freed. ValueError for an unknown name."""
        self._check_open()
        identity = self.adapters.unload(name)
        if identity is not None:
            with self._stepping():
                self.cache.tree.evict_key(identity)

    def adapter_names(self) -> list[str]:
        """The adapters requests may name: a PeftModel's own, then the loaded folders."""
        return self.adapters.names()

    def _resolve_adapter(self, adapter):
        """What a request under `adapter` (a name, or None: the model as it is) runs with."""
        return self.adapters.resolve(adapter)
