"""Where and in which order requests run: prefix-affine sharding and an estimate
of the prefill work an order costs."""

from __future__ import annotations

import torch

from chunk_llama.kv import ChunkPool, KVCacheFull, PrefixTree


def shard_by_app(items: list[tuple[int, str, int]], num_shards: int) -> list[list[int]]:
    """Split (id, app, num_tokens) items over `num_shards` processes.

    Every app goes whole to one shard (its prefix is computed and held once),
    largest first onto the least loaded shard. When there are fewer apps than
    shards, the largest apps are split in halves until every shard can get work.
    Returns each shard's ids in input order.
    """
    if num_shards <= 0:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    groups: dict[str, list[tuple[int, int]]] = {}
    for item_id, app, num_tokens in items:
        groups.setdefault(app, []).append((item_id, num_tokens))
    pieces = list(groups.values())
    while len(pieces) < num_shards and any(len(p) > 1 for p in pieces):
        pieces.sort(key=lambda p: sum(t for _, t in p))
        big = next(p for p in reversed(pieces) if len(p) > 1)
        pieces.remove(big)
        pieces += [big[: len(big) // 2], big[len(big) // 2 :]]
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    loads = [0] * num_shards
    for piece in sorted(pieces, key=lambda p: -sum(t for _, t in p)):
        target = loads.index(min(loads))
        shards[target] += [i for i, _ in piece]
        loads[target] += sum(t for _, t in piece)
    order = {item_id: n for n, (item_id, _, _) in enumerate(items)}
    return [sorted(shard, key=order.__getitem__) for shard in shards]


def simulate_prefill_tokens(prompts: list[list[int]], capacity: int, chunk_size: int, max_batch_size: int,
                            max_new_tokens: int) -> int:
    """Prompt tokens the engine would compute serving `prompts` in this order.

    A model-free replay on a real prefix tree with prefix retention: up to
    `max_batch_size` requests are live, each holding its prompt plus
    `max_new_tokens` tokens, and the oldest leaves when the next one needs room.
    """
    pool = ChunkPool(num_layers=1, num_kv_heads=1, head_dim=1, chunk_size=chunk_size, capacity=capacity,
                     dtype=torch.float32)
    tree = PrefixTree(pool, retain_prefixes=True)
    live: list[int] = []
    computed = 0
    for seq_id, prompt in enumerate(prompts):
        tokens = prompt + [-1 - seq_id] * max_new_tokens  # generated tokens: unique per request
        while True:
            if len(live) < max_batch_size:
                try:
                    matched = tree.insert(seq_id, tokens, max_match=len(prompt) - 1)
                    break
                except KVCacheFull:
                    if not live:
                        raise
            tree.remove(live.pop(0))
        live.append(seq_id)
        computed += len(prompt) - min(matched, len(prompt))
    return computed


def compare_orders(shards: list[list[int]], app_of: dict[int, str], prompts: dict[int, list[int]], *,
                   capacity: int, chunk_size: int, max_batch_size: int, max_new_tokens: int) -> dict:
    """Prefill tokens of every shard served in input order vs grouped by app (as the eval runs)."""
    def prefill_tokens(order: list[list[int]]) -> int:
        return sum(simulate_prefill_tokens([prompts[i] for i in ids], capacity, chunk_size, max_batch_size,
                                           max_new_tokens) for ids in order)

    def grouped(ids: list[int]) -> list[int]:
        first_seen = {app: n for n, app in enumerate(dict.fromkeys(app_of[i] for i in ids))}
        return sorted(ids, key=lambda i: (first_seen[app_of[i]], i))

    return dict(input_order=prefill_tokens(shards),  # each shard lists its ids in input order
                grouped_order=prefill_tokens([grouped(s) for s in shards]))
