"""Property-based tests of the pool and tree: random insert (sharing prefixes that end
anywhere inside a node, which splits it; under one of three keys, the weights that compute
the K/V, so the same tokens under another key share nothing), append, extend, remove,
retain and evict (all, or one key's),
token-granular or by whole chunks, inside and outside steps that commit or roll back;
every invariant checked after every operation.

CI runs at least 10,000 operations; CHUNK_LLAMA_FUZZ_EXAMPLES raises the count.
"""

import os

import torch
from helpers import assert_tree_consistent
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from chunk_llama.kv import ChunkPool, KVCacheFull, PrefixTree
from chunk_llama.step.decode_plan import depth_first_order

NUM_EXAMPLES = int(os.environ.get("CHUNK_LLAMA_FUZZ_EXAMPLES", "160"))
STEPS = 100
# few distinct tokens and short prefixes, so sequences share and collide often
tokens_strategy = st.lists(st.integers(0, 3), min_size=1, max_size=14)


class TreeMachine(RuleBasedStateMachine):
    num_operations = 0

    @initialize(chunk_size=st.sampled_from([1, 2, 4]), capacity=st.integers(3, 20), retain=st.booleans(),
                token_granular=st.sampled_from([True, True, False]))
    def setup(self, chunk_size, capacity, retain, token_granular):
        self.pool = ChunkPool(num_layers=1, num_kv_heads=1, head_dim=1, chunk_size=chunk_size, capacity=capacity,
                              dtype=torch.float32)
        self.tree = PrefixTree(self.pool, retain_prefixes=retain, token_granular=token_granular)
        self.expected: dict[int, list[int]] = {}
        self.key_of: dict[int, str | None] = {}
        self.next_id = 0
        self.at_begin = None  # (sequences, their segments) when the open step began

    def _count(self):
        TreeMachine.num_operations += 1

    @precondition(lambda self: not self.tree.in_step)
    @rule()
    def begin_step(self):
        self._count()
        self.tree.begin_step()
        self.at_begin = ({s: list(t) for s, t in self.expected.items()},
                         {s: self.tree.segments(s) for s in self.expected})

    @precondition(lambda self: self.tree.in_step)
    @rule()
    def commit(self):
        """The forward pass completed."""
        self._count()
        self.tree.commit()

    @precondition(lambda self: self.tree.in_step)
    @rule()
    def rollback(self):
        """The forward pass failed: everything of the step goes, chunk for chunk."""
        self._count()
        self.tree.rollback()
        seqs, segments = self.at_begin
        self.expected = {s: list(t) for s, t in seqs.items()}
        assert {s: self.tree.segments(s) for s in self.expected} == segments

    @rule(tokens=tokens_strategy, cut=st.integers(0, 14), key=st.sampled_from([None, None, "a", "b"]),
          data=st.data())
    def insert(self, tokens, cut, key, data):
        self._count()
        # half the time, start from a live sequence's tokens: a shared prefix
        if self.expected and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sorted(self.expected)))
            tokens = self.expected[base][:cut] + tokens
        free_before = self.pool.num_free
        try:
            matched = self.tree.insert(self.next_id, tokens, max_match=data.draw(st.none() | st.integers(0, 20)),
                                       key=key)
        except KVCacheFull:
            assert self.pool.num_free == free_before and self.next_id not in self.tree
            return
        assert 0 <= matched <= len(tokens)
        self.expected[self.next_id] = list(tokens)
        self.key_of[self.next_id] = key
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
        in_step_changed = bool(self.tree._journal)
        try:
            self.tree.remove(seq_id)
        except RuntimeError as error:  # refused, with nothing changed, and only for that reason
            assert in_step_changed and "uncommitted" in str(error), error
            assert self.tree.tokens(seq_id) == self.expected[seq_id]
            return
        assert not in_step_changed
        del self.expected[seq_id]
        if self.tree.in_step:  # nothing changed yet in this step: as if removed before it
            del self.at_begin[0][seq_id], self.at_begin[1][seq_id]

    @rule(key=st.sampled_from([None, "a", "b"]))
    def evict_key(self, key):
        self._count()
        self.tree.evict_key(key)
        heads = set(self.tree.retained_ids())
        assert not any(n.start == 0 and n.chunk_id in heads for n in self.tree.nodes_under(key))

    @rule()
    def evict_all(self):
        self._count()
        self.tree.evict_all()
        assert self.tree.num_retained == 0

    @invariant()
    def tree_is_consistent(self):
        assert_tree_consistent(self.tree)

    @invariant()
    def sequences_under_every_node_are_contiguous(self):
        order = depth_first_order(self.tree, sorted(self.expected))
        rows: dict[int, list[int]] = {}
        keys = [self.tree.key_of(s) for s in order]  # each key's sequences together too
        assert all(keys.index(k) == i or keys[i - 1] == k for i, k in enumerate(keys))
        for row, seq_id in enumerate(order):
            for node in self.tree.path(seq_id):
                rows.setdefault(id(node), []).append(row)
        for node_rows in rows.values():
            assert node_rows == list(range(node_rows[0], node_rows[0] + len(node_rows)))

    @invariant()
    def whole_chunks_only_when_not_token_granular(self):
        if not self.tree.token_granular:
            for seq_id in self.expected:
                runs = self.tree.segments(seq_id)
                assert all(start == 0 for _, start, _ in runs)
                assert all(count == self.pool.chunk_size for _, _, count in runs[:-1])

    @invariant()
    def a_slot_holds_one_prefix(self):
        """Two sequences read a position from the same slot only when their tokens up to it
        and their keys are the same: nothing one writes is read as another's."""
        seen: dict[tuple[int, int], tuple] = {}
        for seq_id, tokens in self.expected.items():
            assert self.tree.key_of(seq_id) == self.key_of[seq_id]
            chunks, slots = self.tree.slots(seq_id, 0, len(tokens))
            for position, slot in enumerate(zip(chunks, slots)):
                prefix = (self.key_of[seq_id], *tokens[: position + 1])
                assert seen.setdefault(slot, prefix) == prefix
                assert not self.pool.is_free(slot[0])

    @invariant()
    def tokens_read_back(self):
        for seq_id, tokens in self.expected.items():
            assert self.tree.tokens(seq_id) == tokens and self.tree.seq_len(seq_id) == len(tokens)

    def teardown(self):
        if self.tree.in_step:
            self.rollback()
        for seq_id in list(self.expected):
            self.tree.remove(seq_id)
        self.tree.evict_all()
        assert self.pool.num_free == self.pool.capacity and self.tree.nodes() == []
        assert self.tree.keys() == [None]


def test_tree_invariants_under_random_operations():
    TreeMachine.num_operations = 0
    run_state_machine_as_test(
        TreeMachine, settings=settings(max_examples=NUM_EXAMPLES, stateful_step_count=STEPS, deadline=None)
    )
    assert TreeMachine.num_operations >= 10_000, TreeMachine.num_operations
