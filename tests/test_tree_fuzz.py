"""Property-based tests of the pool and tree: random insert, append, extend, remove,
retain and evict, with every invariant checked after every operation.

CI runs at least 10,000 operations; CHUNK_LLAMA_FUZZ_EXAMPLES raises the count.
"""

import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from chunk_llama.kv import ChunkPool, KVCacheFull, PrefixTree
from chunk_llama.kv.plan import depth_first_order

NUM_EXAMPLES = int(os.environ.get("CHUNK_LLAMA_FUZZ_EXAMPLES", "160"))
STEPS = 100
# few distinct tokens and short prefixes, so sequences share and collide often
tokens_strategy = st.lists(st.integers(0, 3), min_size=1, max_size=14)


class TreeMachine(RuleBasedStateMachine):
    num_operations = 0

    @initialize(chunk_size=st.sampled_from([1, 2, 4]), capacity=st.integers(3, 20), retain=st.booleans())
    def setup(self, chunk_size, capacity, retain):
        self.pool = ChunkPool(num_layers=1, num_kv_heads=1, head_dim=1, chunk_size=chunk_size, capacity=capacity,
                              dtype=torch.float32)
        self.tree = PrefixTree(self.pool, retain_prefixes=retain)
        self.expected: dict[int, list[int]] = {}
        self.next_id = 0

    def _count(self):
        TreeMachine.num_operations += 1

    @rule(tokens=tokens_strategy, cut=st.integers(0, 14), data=st.data())
    def insert(self, tokens, cut, data):
        self._count()
        # half the time, start from a live sequence's tokens: a shared prefix
        if self.expected and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sorted(self.expected)))
            tokens = self.expected[base][:cut] + tokens
        free_before = self.pool.num_free
        try:
            matched = self.tree.insert(self.next_id, tokens, max_match=data.draw(st.none() | st.integers(0, 20)))
        except KVCacheFull:
            assert self.pool.num_free == free_before and self.next_id not in self.tree
            return
        assert 0 <= matched <= len(tokens)
        self.tree.take_pending_copies()
        self.expected[self.next_id] = list(tokens)
        self.next_id += 1

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def append(self, data):
        self._count()
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.expected)), min_size=1, unique=True))
        new = [data.draw(st.integers(0, 3)) for _ in seq_ids]
        try:
            self.tree.append(seq_ids, new)
        except KVCacheFull:
            return
        for s, t in zip(seq_ids, new):
            self.expected[s].append(t)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), tokens=tokens_strategy)
    def extend(self, data, tokens):
        self._count()
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        try:
            self.tree.extend(seq_id, tokens)
        except KVCacheFull:
            return
        self.expected[seq_id] += tokens

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def remove(self, data):
        self._count()
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        self.tree.remove(seq_id)
        del self.expected[seq_id]

    @rule()
    def evict_all(self):
        self._count()
        self.tree.evict_all()
        assert self.tree.num_retained == 0

    @invariant()
    def reference_counts_equal_the_sequences_through_each_chunk(self):
        users: dict[int, int] = {}
        for seq_id in self.expected:
            for c in self.tree.chunk_ids(seq_id):
                users[c] = users.get(c, 0) + 1
        nodes = self.tree.nodes()
        for node in nodes:
            assert self.pool.ref_counts[node.chunk_id] == users.get(node.chunk_id, 0)
            if users.get(node.chunk_id, 0) == 0:  # no owner: a retained, full, findable prefix chunk
                assert self.tree.is_retained(node.chunk_id)
                assert len(node.tokens) == self.pool.chunk_size and node.is_indexed()
        assert self.tree.num_retained == sum(1 for n in nodes if users.get(n.chunk_id, 0) == 0)

    @invariant()
    def every_chunk_is_in_the_tree_or_free(self):
        in_tree = [n.chunk_id for n in self.tree.nodes()]
        assert len(in_tree) == len(set(in_tree))
        free = {c for c in range(self.pool.capacity) if self.pool.is_free(c)}
        assert len(free) == self.pool.num_free
        assert set(in_tree).isdisjoint(free) and set(in_tree) | free == set(range(self.pool.capacity))

    @invariant()
    def sequences_under_every_chunk_are_contiguous(self):
        order = depth_first_order(self.tree, sorted(self.expected))
        rows: dict[int, list[int]] = {}
        for row, seq_id in enumerate(order):
            for c in self.tree.chunk_ids(seq_id):
                rows.setdefault(c, []).append(row)
        for chunk_rows in rows.values():
            assert chunk_rows == list(range(chunk_rows[0], chunk_rows[0] + len(chunk_rows)))

    @invariant()
    def tokens_read_back(self):
        for seq_id, tokens in self.expected.items():
            assert self.tree.tokens(seq_id) == tokens and self.tree.seq_len(seq_id) == len(tokens)

    def teardown(self):
        for seq_id in list(self.expected):
            self.tree.remove(seq_id)
        self.tree.evict_all()
        assert self.pool.num_free == self.pool.capacity and self.tree.nodes() == []


def test_tree_invariants_under_random_operations():
    TreeMachine.num_operations = 0
    run_state_machine_as_test(
        TreeMachine, settings=settings(max_examples=NUM_EXAMPLES, stateful_step_count=STEPS, deadline=None)
    )
    assert TreeMachine.num_operations >= 10_000, TreeMachine.num_operations
