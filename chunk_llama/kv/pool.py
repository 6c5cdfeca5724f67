"""Chunk pool: preallocated K/V storage for every layer, addressed by chunk id.

A chunk id is one row in every layer's K and V tensor at once, so the prefix tree
(shared by all layers) allocates a chunk once and every layer writes into its row.
Memory is allocated up front and never returned to the OS while the pool lives;
running out is reported with `KVCacheFull`, which callers turn into an admission
decision instead of a crash. Which chunks hold what is the prefix tree's business: the
pool only hands chunks out and takes them back.
"""

from __future__ import annotations

import torch


class KVCacheFull(RuntimeError):
    """Raised when the pool has too few free chunks for an operation.

    The operation that raised it left the pool and the tree unchanged.
    """


class ChunkPool:
    """Fixed-capacity pool of KV chunks with a free list.

    Storage: `k`, `v`: [num_layers, capacity, num_kv_heads, chunk_size, head_dim].
    `k[layer]` is a contiguous [capacity, num_kv_heads, chunk_size, head_dim] view,
    which is the layout the attention kernels read. With `layer_devices` naming more
    than one device (a model split over GPUs by `device_map`), `k` and `v` are lists of
    each layer's tensor on that layer's device instead. One more chunk per layer lies
    behind the last (never handed out): the CPU kernels read a run of keys in tiles
    that may end up to 15 rows past a run ending inside a chunk (the extra scores are
    never used), and that read must stay inside the allocation.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        chunk_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_devices: list[torch.device] | None = None,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("chunk_size", chunk_size),
            ("capacity", capacity),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.chunk_size = chunk_size
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        if layer_devices is not None and len(layer_devices) != num_layers:
            raise ValueError(f"layer_devices names {len(layer_devices)} devices for {num_layers} layers")
        self.layer_devices = [torch.device(d) for d in layer_devices or [self.device] * num_layers]
        shape = (capacity + 1, num_kv_heads, chunk_size, head_dim)  # + the guard chunk
        # torch.empty: pages are committed on first write, so an unused budget costs no RSS.
        if len(set(self.layer_devices)) == 1:
            self.device = self.layer_devices[0]
            self.k = torch.empty((num_layers, *shape), dtype=dtype, device=self.device)[:, :capacity]
            self.v = torch.empty((num_layers, *shape), dtype=dtype, device=self.device)[:, :capacity]
        else:
            self.k = [torch.empty(shape, dtype=dtype, device=d)[:capacity] for d in self.layer_devices]
            self.v = [torch.empty(shape, dtype=dtype, device=d)[:capacity] for d in self.layer_devices]
        # Pop from the end: low ids first, which keeps the touched memory compact.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * capacity
        self.peak_used = 0

    @staticmethod
    def bytes_per_chunk_for(
        num_layers: int, num_kv_heads: int, head_dim: int, chunk_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes one chunk takes across all layers, K and V together."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * chunk_size * head_dim * element_size

    @property
    def bytes_per_chunk(self) -> int:
        return self.bytes_per_chunk_for(
            self.num_layers, self.num_kv_heads, self.head_dim, self.chunk_size, self.dtype
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def is_free(self, chunk_id: int) -> bool:
        return bool(self._is_free[chunk_id])

    def can_allocate(self, num_chunks: int) -> bool:
        return num_chunks <= len(self._free)

    def allocate(self) -> int:
        """Take one free chunk."""
        if not self._free:
            raise KVCacheFull(f"KV cache is full: all {self.capacity} chunks are in use")
        chunk_id = self._free.pop()
        self._is_free[chunk_id] = 0
        self.peak_used = max(self.peak_used, self.num_used)
        return chunk_id

    def free(self, chunk_id: int) -> None:
        """Return an allocated chunk to the free list."""
        if self._is_free[chunk_id]:
            raise RuntimeError(f"free of chunk {chunk_id}, which is free already")
        self._is_free[chunk_id] = 1
        self._free.append(chunk_id)
