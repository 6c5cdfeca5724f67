"""Pool and prefix tree: exact structure and reference counts after each operation."""

import pytest
import torch

from chunk_llama.kv import ChunkPool, KVCacheFull, PrefixTree, build_decode_plan


def make(capacity=16, chunk_size=4):
    pool = ChunkPool(
        num_layers=2, num_kv_heads=1, head_dim=2, chunk_size=chunk_size, capacity=capacity, dtype=torch.float32
    )
    return pool, PrefixTree(pool)


def refs(pool, tree, seq_id):
    return [pool.ref_counts[c] for c in tree.chunk_ids(seq_id)]


def test_insert_shares_full_chunks_and_counts_references():
    pool, tree = make()
    assert tree.insert(0, list(range(10))) == 0
    assert tree.chunk_ids(0) == [0, 1, 2] and refs(pool, tree, 0) == [1, 1, 1]
    # shares chunks 0 and 1 (8 tokens), then the match continues 1 token into chunk 2
    assert tree.insert(1, list(range(9)) + [99, 98]) == 9
    assert tree.chunk_ids(1)[:2] == [0, 1] and refs(pool, tree, 1) == [2, 2, 1]
    assert tree.chunk_ids(1)[2] not in tree.chunk_ids(0)
    copies = tree.take_pending_copies()
    assert [(c.src, c.dst, c.num_tokens) for c in copies] == [(2, tree.chunk_ids(1)[2], 1)]
    assert tree.tokens(1) == list(range(9)) + [99, 98]
    assert pool.num_used == 4
    # an unrelated sequence is a new tree in the forest
    assert tree.insert(2, [50, 51]) == 0
    assert refs(pool, tree, 2) == [1] and tree.root.children.keys() == {0, tree.chunk_ids(2)[0]}


def test_max_match_leaves_the_last_token_to_compute():
    pool, tree = make()
    tree.insert(0, list(range(8)))
    # identical prompt: 8 tokens match, but at most 7 may; chunk 1 cannot be shared whole
    assert tree.insert(1, list(range(8)), max_match=7) == 7
    assert refs(pool, tree, 1) == [2, 1]
    assert [(c.src, c.num_tokens) for c in tree.take_pending_copies()] == [(1, 3)]


def test_append_grows_private_chunks_and_fills_index():
    pool, tree = make()
    tree.insert(0, [1, 2, 3])
    tree.insert(1, [1, 2, 3, 4, 5])
    version = tree.structure_version
    tree.take_chunk_events()
    chunk_ids, offsets = tree.append([0, 1], [4, 6])
    assert offsets == [3, 1]
    assert chunk_ids == [tree.chunk_ids(0)[0], tree.chunk_ids(1)[1]]
    assert tree.structure_version == version and tree.take_chunk_events() == []  # the plan stays valid
    # both first chunks now hold [1, 2, 3, 4]; the first to fill (sequence 1's) is the
    # one indexed for sharing, and a newcomer shares it
    assert tree.root.full_children[(1, 2, 3, 4)].chunk_id == tree.chunk_ids(1)[0]
    assert tree.insert(2, [1, 2, 3, 4, 9]) == 4 and tree.chunk_ids(2)[0] == tree.chunk_ids(1)[0]
    tree.remove(2)
    version = tree.structure_version
    tree.append([0], [7])
    # a new private chunk: reported as an event, the structure (and plan order) is unchanged
    assert tree.structure_version == version and len(tree.chunk_ids(0)) == 2
    assert tree.take_chunk_events() == [(0, tree.chunk_ids(0)[1])]


def test_remove_frees_only_unshared_chunks_and_pool_returns_to_full():
    pool, tree = make()
    tree.insert(0, list(range(12)))
    tree.insert(1, list(range(8)) + [7, 7])
    tree.insert(2, list(range(4)) + [5])
    assert refs(pool, tree, 0) == [3, 2, 1]
    tree.remove(0)
    assert refs(pool, tree, 1) == [2, 1, 1]  # chunk 0 is still shared with sequence 2
    assert pool.num_used == 4
    tree.remove(2)
    assert refs(pool, tree, 1) == [1, 1, 1]
    tree.remove(1)
    assert pool.num_used == 0 and pool.num_free == pool.capacity
    assert not tree.root.children and not tree.root.full_children
    assert all(count == 0 for count in pool.ref_counts)


def test_kv_cache_full_leaves_everything_unchanged():
    pool, tree = make(capacity=3)
    tree.insert(0, list(range(8)))
    with pytest.raises(KVCacheFull):
        tree.insert(1, [9] * 9)
    assert 1 not in tree and pool.num_used == 2
    tree.insert(2, [9])
    tree.append([2], [9])  # room left in sequence 2's chunk: no allocation
    with pytest.raises(KVCacheFull):  # sequence 0 is at a chunk boundary and no chunk is free
        tree.append([2, 0], [9, 8])
    assert tree.seq_len(0) == 8 and tree.seq_len(2) == 2


def test_depth_first_order_makes_shared_ranges_contiguous():
    pool, tree = make(capacity=64)
    prefix_a, prefix_b = [1] * 8, [2] * 8
    sequences = {
        0: prefix_a + [3],
        1: prefix_b + [4],
        2: prefix_a + [5],
        3: prefix_b + [6, 6, 6, 6, 7],
        4: [9, 9],
        5: prefix_b + [6, 6, 6, 6, 8],
    }
    for seq_id, tokens in sequences.items():
        tree.insert(seq_id, tokens)
    plan = build_decode_plan(tree, list(sequences))
    rows = {s: r for r, s in enumerate(plan.seq_ids)}
    for chunk, begin, end in zip(plan.shared_chunk_ids.tolist(), plan.shared_begin.tolist(), plan.shared_end.tolist()):
        users = {s for s in sequences if chunk in tree.chunk_ids(s)}
        assert {plan.seq_ids[r] for r in range(begin, end)} == users
        assert end - begin == pool.ref_counts[chunk] == len(users)
    assert abs(rows[0] - rows[2]) == 1 and abs(rows[3] - rows[5]) == 1
    # every sequence's chunks: shared ones first, then its private ones
    for row, seq_id in enumerate(plan.seq_ids):
        num_shared = plan.num_shared_tokens[row].item() // 4
        private = [c for c in plan.private_chunk_ids[row].tolist()[: len(tree.chunk_ids(seq_id)) - num_shared]]
        assert private == tree.chunk_ids(seq_id)[num_shared:]


def test_match_len_and_chunks_needed():
    pool, tree = make()
    tree.insert(0, list(range(10)))
    assert tree.match_len(list(range(6)) + [42]) == 6
    assert tree.chunks_needed(list(range(12))) == 1  # 8 shared, 4 new tokens in 1 chunk
    assert tree.chunks_needed(list(range(8)), max_match=7) == 1


def test_invalid_pool_arguments():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkPool(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=0, capacity=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        ChunkPool(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=4, capacity=-1, dtype=torch.float32)


def test_plan_updates_in_place_match_a_fresh_build():
    pool, tree = make(capacity=64)
    for seq_id, tokens in enumerate([[1] * 8 + [2], [1] * 8 + [3, 3, 3], [4] * 3]):
        tree.insert(seq_id, tokens)
    plan = build_decode_plan(tree, [0, 1, 2])
    for step in range(9):
        tree.append([0, 1, 2], [10 + step] * 3)
        events = tree.take_chunk_events()
        if events:
            plan.add_private_chunks(events)
        plan.advance()
        fresh = build_decode_plan(tree, [0, 1, 2])
        assert plan.seq_ids == fresh.seq_ids
        assert torch.equal(plan.seq_lens, fresh.seq_lens)
        width = fresh.private_chunk_ids.shape[1]
        assert torch.equal(plan.private_chunk_ids[:, :width], fresh.private_chunk_ids)
        assert not plan.private_chunk_ids[:, width:].any()


def test_pair_index_from_depth_and_csr():
    pool, tree = make(capacity=64)
    for seq_id, tokens in enumerate([[1] * 8 + [2], [1] * 8 + [3], [1] * 4 + [5], [7]]):
        tree.insert(seq_id, tokens)
    plan = build_decode_plan(tree, [0, 1, 2, 3])
    ptr, depth = plan.seq_pair_ptr.tolist(), plan.shared_depth.tolist()
    for p, (s, row) in enumerate(zip(plan.pair_shared.tolist(), plan.pair_seq.tolist())):
        assert p == ptr[row] + depth[s]
    assert ptr[-1] == plan.pair_seq.numel()
