"""Pool and prefix tree: exact structure, slots and counts after each operation."""

import pytest
import torch
from helpers import assert_tree_consistent

from chunk_llama.kv import ChunkPool, KVCacheFull, PrefixTree
from chunk_llama.step import NO_POSITION, build_decode_plan


def make(capacity=16, chunk_size=4, **tree_options):
    pool = ChunkPool(
        num_layers=2, num_kv_heads=1, head_dim=2, chunk_size=chunk_size, capacity=capacity, dtype=torch.float32
    )
    return pool, PrefixTree(pool, **tree_options)


def counts(tree, seq_id):
    return [node.num_seqs for node in tree.path(seq_id)]


def test_insert_shares_the_common_prefix_to_the_token():
    pool, tree = make()
    assert tree.insert(0, list(range(10))) == 0
    assert tree.segments(0) == [(0, 0, 4), (1, 0, 4), (2, 0, 2)] and counts(tree, 0) == [1, 1, 1]
    # shares chunks 0 and 1 (8 tokens) and the first slot of chunk 2, where the two part:
    # chunk 2 is split there, sequence 0 keeps its second slot in place, nothing is copied
    assert tree.insert(1, list(range(9)) + [99, 98]) == 9
    assert tree.segments(1) == [(0, 0, 4), (1, 0, 4), (2, 0, 1), (3, 0, 2)] and counts(tree, 1) == [2, 2, 2, 1]
    assert tree.segments(0) == [(0, 0, 4), (1, 0, 4), (2, 0, 2)] and counts(tree, 0) == [2, 2, 2, 1]
    assert tree.tokens(0) == list(range(10)) and tree.tokens(1) == list(range(9)) + [99, 98]
    assert pool.num_used == 4
    # an unrelated sequence is a new tree in the forest
    assert tree.insert(2, [50, 51]) == 0
    assert counts(tree, 2) == [1] and len(tree.root.children) == 2
    assert_tree_consistent(tree)


def test_max_match_leaves_the_last_token_to_compute():
    pool, tree = make()
    tree.insert(0, list(range(8)))
    # identical prompt: 8 tokens match, but at most 7 may: chunk 1 is shared for 3 slots
    assert tree.insert(1, list(range(8)), max_match=7) == 7
    assert tree.segments(1) == [(0, 0, 4), (1, 0, 3), (2, 0, 1)] and counts(tree, 1) == [2, 2, 1]
    assert tree.slots(1, 6, 8) == ([1, 2], [2, 0]) and tree.slots(0, 6, 8) == ([1, 1], [2, 3])


def test_appends_extend_in_place_or_go_on_behind_a_shared_node():
    pool, tree = make()
    tree.insert(0, [1, 2, 3])
    # sequence 1 holds all of sequence 0 and goes on in place, in the slot behind it
    assert tree.insert(1, [1, 2, 3, 4, 5]) == 3
    assert tree.segments(1) == [(0, 0, 4), (1, 0, 1)] and pool.num_used == 2
    tree.take_node_events()
    version = tree.structure_version
    # sequence 1's last node is its own: it grows in place; sequence 0's is shared: it goes on
    # in a fresh chunk (the slot behind is sequence 1's), a new node reported as an event
    assert tree.append([1, 0], [6, 7]) == ([1, 2], [1, 0])
    assert tree.segments(0) == [(0, 0, 3), (2, 0, 1)] and tree.segments(1) == [(0, 0, 4), (1, 0, 2)]
    assert tree.structure_version == version  # the plan stays valid
    events = tree.take_node_events()
    assert [(s, n.key, position) for s, n, position in events] == [(0, (2, 0), 3)]
    # a newcomer that holds all of sequence 0's first node shares it and finds sequence 1's
    # [4] behind it by content
    assert tree.match_len([1, 2, 3, 4, 5, 9]) == 5 and tree.match_len([1, 2, 3, 7]) == 4
    assert_tree_consistent(tree)


def test_remove_releases_only_unused_nodes_and_pool_returns_to_full():
    pool, tree = make()
    tree.insert(0, list(range(12)))
    tree.insert(1, list(range(8)) + [7, 7])
    tree.insert(2, list(range(4)) + [5])
    assert counts(tree, 0) == [3, 2, 1]
    tree.remove(0)
    assert counts(tree, 1) == [2, 1, 1]  # chunk 0 is still shared with sequence 2
    assert pool.num_used == 4
    tree.remove(2)
    assert counts(tree, 1) == [1, 1, 1]
    tree.remove(1)
    assert pool.num_used == 0 and pool.num_free == pool.capacity
    assert not tree.root.children and not tree.root.by_token


def test_split_nodes_go_when_their_sequences_do():
    pool, tree = make()
    tree.insert(0, list(range(6)))
    tree.insert(1, list(range(5)) + [9, 9])
    assert pool.num_used == 3
    tree.remove(0)  # chunk 1 stays: its head is sequence 1's; sequence 0's slot behind it is released
    assert tree.segments(1) == [(0, 0, 4), (1, 0, 1), (2, 0, 2)] and pool.num_used == 3
    assert tree.match_len(list(range(6))) == 5
    assert_tree_consistent(tree)
    tree.remove(1)
    assert pool.num_used == 0 and tree.nodes() == []


def test_a_common_prefix_ending_inside_a_chunk_is_held_once():
    """16 prompts share 2,008 tokens (31 chunks of 64 and 24 tokens), then 15-30 tokens
    each: 32 chunks for the prefix (the first prompt's own tokens behind it, in place), one
    more for each other prompt's own tokens."""
    pool, tree = make(capacity=64, chunk_size=64)
    prefix = [7] * 2008
    for i in range(16):
        tree.insert(i, prefix + [100 + i] * (15 + i), max_match=len(prefix) + 14 + i)
    assert pool.num_used == 32 + 15
    for i in range(16):
        assert tree.segments(i)[31] == (tree.chunk_ids(0)[31], 0, 24 if i else 24 + 15)
    assert_tree_consistent(tree)


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
    assert_tree_consistent(tree)


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
        6: prefix_b + [6, 6, 1],  # parts from 3 and 5 inside their third chunk
    }
    for seq_id, tokens in sequences.items():
        tree.insert(seq_id, tokens)
    plan = build_decode_plan(tree, list(sequences))
    rows = {s: r for r, s in enumerate(plan.seq_ids)}
    shared = zip(plan.shared_chunk_ids.tolist(), plan.shared_start.tolist(), plan.shared_begin.tolist(),
                 plan.shared_end.tolist())
    for chunk, start, begin, end in shared:
        users = {s for s in sequences if any(n.key == (chunk, start) for n in tree.path(s))}
        assert {plan.seq_ids[r] for r in range(begin, end)} == users
    assert abs(rows[0] - rows[2]) == 1 and {rows[3], rows[5], rows[6]} == set(range(min(rows[3], rows[5], rows[6]),
                                                                                   max(rows[3], rows[5], rows[6]) + 1))
    # every sequence's segments: shared ones first, then its private ones, at their positions
    for row, seq_id in enumerate(plan.seq_ids):
        private = []  # the path's nodes no other sequence uses, a chunk's run of them one segment
        for node in tree.path(seq_id):
            if node.num_seqs == 1 and private and private[-1][0] == node.chunk_id:
                private[-1][2] += len(node.tokens)
            elif node.num_seqs == 1:
                private.append([node.chunk_id, node.start, len(node.tokens)])
        n = len(private)
        assert plan.private_chunk_ids[row, :n].tolist() == [c for c, _, _ in private]
        assert plan.private_start[row, :n].tolist() == [s for _, s, _ in private]
        assert plan.private_pos[row, n].item() == NO_POSITION
        assert plan.num_shared_tokens[row] + sum(k for *_, k in private) == tree.seq_len(seq_id)
    assert not plan.aligned  # sequence 6's third chunk is split after 2 slots


def test_match_len_and_chunks_needed():
    pool, tree = make()
    tree.insert(0, list(range(10)))
    assert tree.match_len(list(range(6)) + [42]) == 6
    # all 10 tokens held; 2 more fit in place behind them (sequence 0 then goes on elsewhere)
    assert tree.chunks_needed(list(range(12))) == 0
    assert tree.chunks_needed(list(range(13))) == 1
    assert tree.chunks_needed(list(range(8)), max_match=7) == 1  # chunk 1 split: the last token goes elsewhere


def test_whole_chunks_only_when_not_token_granular():
    pool, tree = make(token_granular=False)
    tree.insert(0, list(range(10)))
    assert tree.insert(1, list(range(9)) + [99]) == 8  # the partly matched third chunk is not shared
    assert tree.segments(1) == [(0, 0, 4), (1, 0, 4), (3, 0, 2)]
    assert tree.insert(2, list(range(10)) + [5]) == 8  # nor is a partly filled one, even whole
    assert tree.match_len(list(range(7))) == 4
    plan = build_decode_plan(tree, [0, 1, 2])
    assert plan.aligned


def test_invalid_pool_arguments():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkPool(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=0, capacity=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        ChunkPool(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=4, capacity=-1, dtype=torch.float32)


@pytest.mark.parametrize("token_granular", [True, False])
def test_plan_updates_in_place_match_a_fresh_build(token_granular):
    pool, tree = make(capacity=64, token_granular=token_granular)
    # 0 and 3 end on a node they share (1 goes on in place behind it): their appends start new nodes
    for seq_id, tokens in enumerate([[1] * 6, [1] * 8 + [3, 3, 3], [4] * 3, [1] * 6]):
        tree.insert(seq_id, tokens)
    plan = build_decode_plan(tree, [0, 1, 2, 3])
    for step in range(9):
        tree.append([0, 1, 2, 3], [10 + step] * 4)
        events = tree.take_node_events()
        if events:
            plan.add_private_nodes(events)
        plan.advance()
        fresh = build_decode_plan(tree, [0, 1, 2, 3])
        # a sequence that went on behind a node it shares may sort elsewhere in a fresh
        # build; each sequence's own data must be the same
        assert plan.aligned == fresh.aligned
        for seq_id in range(4):
            row, fresh_row = plan.row_of[seq_id], fresh.row_of[seq_id]
            assert plan.seq_lens[row] == fresh.seq_lens[fresh_row]
            assert plan.num_shared_tokens[row] == fresh.num_shared_tokens[fresh_row]
            n = fresh.num_private[fresh_row]
            for name in ("private_chunk_ids", "private_start", "private_pos"):
                assert torch.equal(getattr(plan, name)[row, :n], getattr(fresh, name)[fresh_row, :n]), name
            assert (plan.private_pos[row, n:] == NO_POSITION).all()
    assert plan.aligned == (not token_granular)


def test_pair_index_from_depth_and_csr():
    pool, tree = make(capacity=64)
    for seq_id, tokens in enumerate([[1] * 8 + [2], [1] * 8 + [3], [1] * 4 + [5], [7], [1] * 6 + [6]]):
        tree.insert(seq_id, tokens)
    plan = build_decode_plan(tree, [0, 1, 2, 3, 4])
    ptr, depth = plan.seq_pair_ptr.tolist(), plan.shared_depth.tolist()
    for p, (s, row) in enumerate(zip(plan.pair_shared.tolist(), plan.pair_seq.tolist())):
        assert p == ptr[row] + depth[s]
    assert ptr[-1] == plan.pair_seq.numel()


def test_a_key_matches_only_its_own_nodes_and_holds_a_prefix_once():
    """K/V computed under one key (the base, an adapter) are never matched under another; under
    one key a prefix is held once; retention and eviction go per key, LRU across keys."""
    pool, tree = make(capacity=9, retain_prefixes=True)
    prompt = list(range(10))  # 3 chunks of 4
    assert tree.insert(0, prompt) == 0
    assert tree.insert(1, prompt, key="a") == 0  # the base's chunks are not a's
    assert tree.insert(2, prompt + [20], key="a") == 10  # a's are (in place, behind its last node)
    assert tree.match_len(prompt, key="b") == 0 and tree.match_len(prompt) == tree.match_len(prompt, key="a") == 10
    assert pool.num_used == 6 and tree.keys() == [None, "a"] and tree.key_of(2) == "a"
    assert not set(tree.chunk_ids(0)) & set(tree.chunk_ids(1))
    assert_tree_consistent(tree)
    for seq_id in (1, 2, 0):  # a's chunks retained first: the least recently used
        tree.remove(seq_id)
    assert tree.retained_by_key() == {None: 3, "a": 3}
    # 6 chunks under "b" need 3 evicted: a's, the oldest, whatever key they are of
    tree.insert(3, list(range(50, 74)), key="b")
    assert tree.retained_by_key() == {None: 3} and tree.keys() == [None, "b"]
    assert tree.match_len(prompt) == 10 and tree.match_len(prompt, key="a") == 0
    tree.remove(3)
    assert tree.evict_key(None) == 3 and tree.retained_by_key() == {"b": 6}
    assert tree.forget_key("b") == 6 and tree.keys() == [None] and pool.num_free == pool.capacity
    assert_tree_consistent(tree)
