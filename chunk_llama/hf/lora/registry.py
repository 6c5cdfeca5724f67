"""The adapters one engine serves, by name: `AdapterRegistry`.

Two kinds of adapter:
- folders PEFT saved (`load(name, path)`: `--lora-modules`, `POST /v1/load_lora_adapter`),
  checked against the base when registered (`adapter.check_against`). At most `max_loras`
  of them are resident (their weights in memory) at once: the least recently used one not
  in use by a running request gives its place, and is read again from its folder when a
  request needs it (the scheduler waits while every resident one is in use);
- the adapters of a PEFT `PeftModel` handed to the engine, by their PEFT names, read from
  its layers (`peft_model.py`; no copy, always resident); a request naming none computes
  what the model computes as it stands (its active adapters, or the base).

A request resolves its adapter's name when it is submitted (`resolve`: ValueError for an
unknown one) and gets its weights when admitted (`acquire`). The prefix tree keys its K/V by
the weights' identity, so an adapter replaced under the same name shares nothing with
the one it replaced; what a PEFT adapter written in place computed before is forgotten
(`take_stale`), and everything is when PEFT merges adapters into the base.

A PeftModel whose tuner layers the engine cannot add per row (non-LoRA tuners, DoRA...)
runs PEFT's own forward for every request (`rows_managed` False), as it would under stock
`generate`: naming an adapter is then refused, with the reason.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import nn

from chunk_llama.hf.lora.adapter import LoraAdapter, check_against, placed, read_peft_dir
from chunk_llama.hf.lora.layers import attach, lora_linears
from chunk_llama.hf.lora.peft_model import PeftAdapters, tuner_layers, unsupported_reason


class AdapterUnavailable(ValueError):
    """A registered adapter's folder no longer reads as an adapter that fits the base."""


class AdapterEntry:
    """A registered adapter folder: its name and path, its weights while resident (else None),
    and their identity as last read."""

    def __init__(self, adapter: LoraAdapter):
        self.name, self.path, self.identity = adapter.name, adapter.source, adapter.identity
        self.adapter: LoraAdapter | None = adapter
        self.nbytes = adapter.nbytes


class AdapterRegistry:
    """Adapters by name for one engine (module doc). Thread-safe."""

    def __init__(self, model: nn.Module, *, max_loras: int | None = None, max_lora_rank: int | None = None,
                 dtype: torch.dtype = torch.float32):
        for option, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{option} must be a positive int or None, got {value!r}")
        self.model, self.max_loras, self.max_lora_rank, self.dtype = model, max_loras, max_lora_rank, dtype
        self._lock = threading.Lock()
        self._entries: dict[str, AdapterEntry] = {}
        self._resident: OrderedDict[int, AdapterEntry] = OrderedDict()  # id(entry) -> entry, LRU first
        self._stale: list[str] = []
        self._base_changed = False
        self.peft = PeftAdapters(model) if tuner_layers(model) else None
        self.peft_reason: str | None = None
        self._attached = -1  # the PEFT layers' generation whose layers are attached
        self._sync_peft()
        self._base_state = self.peft.base_state() if self.peft is not None else None

    def _sync_peft(self) -> None:
        """Where PEFT added or removed adapters (its layers found again), wrap the new LoRA layers
        (`layers.attach`: a layer left out would apply PEFT's active adapter to every row), or
        note why per-request adapters cannot run on them."""
        if self.peft is None:
            return
        layers = self.peft.layers()
        if self.peft.generation == self._attached:
            return
        reason = unsupported_reason(layers)
        if self._attached >= 0 and (reason is None) != (self.peft_reason is None):
            # (this engine's cache keys K/V one way or the other, chosen when it was made)
            raise RuntimeError(f"PEFT's layers changed kind since this engine was made ({reason or 'now plain LoRA'}): "
                               "make a new engine for the model")
        self.peft_reason = reason
        if reason is None:
            attach(self.model, layers)
        self._attached = self.peft.generation

    @property
    def rows_managed(self) -> bool:
        """Whether the engine assigns adapters per row (else PEFT's forward applies its own)."""
        return self.peft_reason is None

    # ------------------------------------------------------------ registration
    def load(self, name: str, path: str) -> tuple[LoraAdapter, str | None]:
        """Register the adapter PEFT saved in `path` as `name` (replacing one of that name);
        returns it and the identity of the one it replaced (None if none, or the same). ValueError
        naming what does not fit (module doc of `adapter.py`)."""
        self._check_name(name)
        if self.peft is not None and name in self.peft.names():
            raise ValueError(f"adapter {name!r} is one of the PeftModel's own; load another name")
        if not self.rows_managed:
            raise ValueError(f"adapters cannot run per request on this model: {self.peft_reason}")
        adapter = self._read(name, path)
        entry = AdapterEntry(adapter)
        with self._lock:
            old = self._entries.get(name)
            self._entries[name] = entry
            if old is not None:
                self._resident.pop(id(old), None)
            self._make_resident(entry, set())
            replaced = old.identity if old is not None and not self._identity_in_use(old.identity) else None
        return adapter, replaced

    def unload(self, name: str) -> str | None:
        """Forget the adapter registered as `name` (requests already submitted under it finish
        with it); returns its identity, or None where another name holds the same weights.
        ValueError if there is none."""
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is None:
                raise ValueError(f"unknown adapter {name!r}" + self._known())
            self._resident.pop(id(entry), None)
            return None if self._identity_in_use(entry.identity) else entry.identity

    def _identity_in_use(self, identity: str) -> bool:
        return any(entry.identity == identity for entry in self._entries.values())

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = read_peft_dir(name, path, self.dtype)
        linears = lora_linears(self.model)
        check_against(adapter, linears, self.max_lora_rank, type(self.model).__name__)
        adapter = placed(adapter, {key: linears[key][2] for key in adapter.modules})
        attach(self.model, adapter.modules)
        return adapter

    @staticmethod
    def _check_name(name) -> None:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"an adapter name must be a non-empty string without surrounding spaces, got {name!r}")

    def _known(self) -> str:
        names = self.names()
        return f"; known adapters: {', '.join(names)}" if names else "; no adapter is loaded"

    def names(self) -> list[str]:
        peft = self.peft.names() if self.peft is not None and self.rows_managed else []
        with self._lock:
            return [*peft, *self._entries]

    def describe(self) -> list[dict]:
        """One dict per adapter: name, rank, targets, where it is from, whether resident."""
        out = []
        for name in self.names():
            entry = self._entries.get(name)
            adapter = entry.adapter if entry is not None else self.peft.get(name)[0]
            out.append(dict(name=name, source=entry.path if entry is not None else "peft",
                            resident=adapter is not None, identity=entry.identity if entry else adapter.identity,
                            rank=adapter.rank if adapter else None, targets=adapter.targets if adapter else None))
        return out

    # ------------------------------------------------------------- requests
    def resolve(self, name: str | None):
        """What a request under `name` runs with (None: the model as it is), when submitted:
        an `AdapterEntry` (a folder), a `LoraAdapter` (a PEFT adapter now), or None (the
        base). ValueError for an unknown name or one that cannot run per request."""
        self._sync_peft()
        if name is None:
            if self.peft is None or not self.rows_managed:
                return None
            self.check_base()
            adapter, stale = self.peft.as_it_stands()
            self._note_stale(stale)
            return adapter
        self._check_name(name)
        if not self.rows_managed:
            raise ValueError(f"adapter {name!r}: adapters cannot run per request on this model: {self.peft_reason}")
        with self._lock:
            entry = self._entries.get(name)
        if entry is not None:
            return entry
        if self.peft is not None and name in self.peft.names():
            self.check_base()
            if any(layer.merged for layer in self.peft.layers().values()):
                raise ValueError(f"adapter {name!r}: the PeftModel's adapters are merged into its weights; unmerge "
                                 "them to run adapters per request")
            adapter, stale = self.peft.get(name)
            self._note_stale([stale] if stale is not None else [])
            return adapter
        raise ValueError(f"unknown adapter {name!r}" + self._known())

    def acquire(self, ref, busy: set) -> LoraAdapter | None:
        """The weights of a request's adapter (`resolve`'s result) as it is admitted, made
        resident if they are not (evicting the least recently used adapter not in `busy`, the
        entries running requests use), or None if every resident place is in use (wait).
        An entry unloaded or replaced since the request resolved it is no longer registered:
        its weights serve the requests that hold it but take no resident place (they would
        count toward `max_loras` until evicted, and no later request can name them).
        Raises `AdapterUnavailable` if a folder no longer reads as an adapter that fits."""
        if not isinstance(ref, AdapterEntry):
            return ref
        with self._lock:
            registered = self._entries.get(ref.name) is ref
            if ref.adapter is not None:
                if registered:
                    self._make_resident(ref, busy)  # (the most recently used now)
                return ref.adapter
            if registered and not self._room(busy):
                return None
        try:
            adapter = self._read(ref.name, ref.path)
        except (OSError, ValueError) as error:
            raise AdapterUnavailable(f"adapter {ref.name!r} could not be read again from {ref.path}: {error}") \
                from error
        with self._lock:
            ref.identity, ref.nbytes = adapter.identity, adapter.nbytes
            ref.adapter = adapter
            if self._entries.get(ref.name) is ref:
                self._make_resident(ref, busy)
        return adapter

    def _room(self, busy: set) -> bool:
        return self.max_loras is None or len(self._resident) < self.max_loras or any(
            entry not in busy for entry in self._resident.values())

    def _make_resident(self, entry: AdapterEntry, busy: set) -> None:
        """(under the lock) `entry` the most recently used resident, the LRU ones not in
        `busy` evicted beyond `max_loras`."""
        self._resident[id(entry)] = entry
        self._resident.move_to_end(id(entry))
        if self.max_loras is None:
            return
        for key, other in list(self._resident.items()):
            if len(self._resident) <= self.max_loras:
                break
            if other is not entry and other not in busy:
                del self._resident[key]
                other.adapter = None

    @property
    def resident_bytes(self) -> int:
        """Bytes of the loaded folders' weights in memory (a PeftModel's own are PEFT's)."""
        with self._lock:
            return sum(entry.nbytes for entry in self._resident.values())

    @property
    def num_resident(self) -> int:
        """Adapters whose weights are in memory: the resident folders and a PeftModel's own."""
        peft = len(self.peft.names()) if self.peft is not None and self.rows_managed else 0
        with self._lock:
            return len(self._resident) + peft

    def names_of_keys(self, counts: dict) -> dict:
        """`counts` by prefix-tree key (an identity, None: the base) by the names holding
        that identity now (the identity's first 12 characters where no name does)."""
        with self._lock:
            names = {entry.identity: entry.name for entry in self._entries.values()}
        if self.peft is not None:
            names |= {read[0].identity: name for name, read in self.peft.read_adapters().items()}
        return {(None if key is None else names.get(key, str(key)[:12])): n for key, n in counts.items()}

    # --------------------------------------------------------- weights changed
    def _note_stale(self, adapters: list[LoraAdapter]) -> None:
        with self._lock:
            self._stale += [adapter.identity for adapter in adapters]

    def take_stale(self) -> tuple[bool, list[str]]:
        """(whether the base weights changed, so no K/V computed before may be matched again;
        the identities of adapters whose weights were written in place since) since the last
        call; called between steps, it also wraps any LoRA layer PEFT added since)."""
        self._sync_peft()
        self.check_base()
        with self._lock:
            stale, self._stale = self._stale, []
            base, self._base_changed = self._base_changed, False
        return base, stale

    def check_base(self) -> None:
        """Note whether PEFT changed the base weights (merged or unmerged adapters)."""
        if self.peft is None:
            return
        state = self.peft.base_state()
        if state != self._base_state:
            with self._lock:
                self._base_state, self._base_changed = state, True
