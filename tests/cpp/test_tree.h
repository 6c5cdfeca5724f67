// The torch-free drivers' prefix trees: token sequences laid out in pool chunks the
// way chunk_llama/kv/tree.py lays them out, token-granular, and cut into the segments
// the kernels read (chunk_llama/step/decode_plan.py). Where sequences part inside a chunk, the
// node is split: the shared part keeps slots [0, k) (or [start, k)), the rest of the
// sequence that was there stays in place behind it as its own continuation, and the
// sequence that parts goes on in a fresh chunk. A sequence that goes on past the
// whole path of an earlier one continues in place behind it while the chunk has room.
// So shared segments end (and start) inside chunks, private ones start inside chunks,
// and a private segment can end inside a chunk before the sequence's next one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "test_rng.h"

// Slots [start, start + len) of one pool chunk, at positions pos .. of every sequence
// whose path runs through it; users: how many do (2 or more: a shared segment).
struct Segment {
  int64_t chunk, start, len, pos;
  int users;
};

struct Tree {
  std::vector<std::vector<Segment>> paths;  // each sequence's segments, from position 0
  int capacity = 0;                         // pool chunks (a guard chunk goes behind them)
};

namespace test_tree {

// A node of tree.py: a run of tokens in slots [start, start + tokens) of one chunk.
struct Node {
  int64_t chunk;
  int start;
  std::vector<int> tokens;
  int parent;
  int users = 0;              // sequences whose path runs through the node
  std::vector<int> children;  // at most one per first token: a match follows it
  int end() const { return start + static_cast<int>(tokens.size()); }
};

// tree.py's _split: node x keeps its tokens from n on, in place, under a new node (its
// old place in the parent) that holds the first n in the same slots; returns the new one.
inline int split(std::vector<Node>& nodes, int x, int n) {
  Node head{nodes[x].chunk, nodes[x].start, {}, nodes[x].parent, nodes[x].users, {x}};
  head.tokens.assign(nodes[x].tokens.begin(), nodes[x].tokens.begin() + n);
  const int h = static_cast<int>(nodes.size());
  nodes.push_back(head);
  for (int& child : nodes[nodes[x].parent].children)
    if (child == x) child = h;
  nodes[x].start += n, nodes[x].parent = h;
  nodes[x].tokens.erase(nodes[x].tokens.begin(), nodes[x].tokens.begin() + n);
  return h;
}

}  // namespace test_tree

// Inserts the sequences in order as PrefixTree.insert does (the longest cached prefix is
// shared, a node split where the sequence parts inside it; the rest grows in place behind
// its last shared node when that chunk has unclaimed slots, else in fresh chunks), then
// cuts each path into segments as plan.py's path_segments: consecutive nodes in one chunk
// with as many users. Chunk ids are scrambled over the pool with 3 spare chunks unused.
inline Tree build_tree(const std::vector<std::vector<int>>& seqs, int chunk_size, Rng& rng) {
  using test_tree::Node;
  std::vector<Node> nodes{Node{-1, 0, {}, -1, 0, {}}};  // the virtual root
  std::vector<int> leaves;  // each sequence's last node
  int num_chunks = 0;
  for (const std::vector<int>& seq : seqs) {
    int node = 0;
    size_t at = 0;
    while (at < seq.size()) {  // match
      int next = -1;
      for (int child : nodes[node].children)
        if (nodes[child].tokens[0] == seq[at]) next = child;
      if (next < 0) break;
      size_t n = 1;
      while (n < nodes[next].tokens.size() && at + n < seq.size() && nodes[next].tokens[n] == seq[at + n]) ++n;
      // parting inside the node: share its first n tokens (the loop then stops, the
      // split-off head's only child starting with another token or the sequence ending)
      if (n < nodes[next].tokens.size()) next = test_tree::split(nodes, next, static_cast<int>(n));
      node = next, at += n;
    }
    for (int x = node; x > 0; x = nodes[x].parent) ++nodes[x].users;
    while (at < seq.size()) {  // grow
      const Node& leaf = nodes[node];
      const bool extends = node > 0 && leaf.users == 1 && leaf.children.empty() && leaf.end() < chunk_size;
      if (!extends) {  // a new node: behind the leaf in its chunk if no child is there yet
        bool in_place = node > 0 && leaf.end() < chunk_size;
        for (int child : leaf.children)
          in_place &= !(nodes[child].chunk == leaf.chunk && nodes[child].start == leaf.end());
        Node child{in_place ? leaf.chunk : num_chunks++, in_place ? leaf.end() : 0, {}, node, 1, {}};
        nodes[node].children.push_back(static_cast<int>(nodes.size()));
        node = static_cast<int>(nodes.size());
        nodes.push_back(child);
      }
      const size_t take = std::min<size_t>(chunk_size - nodes[node].end(), seq.size() - at);
      nodes[node].tokens.insert(nodes[node].tokens.end(), seq.begin() + at, seq.begin() + at + take);
      at += take;
    }
    leaves.push_back(node);
  }

  Tree tree;
  tree.capacity = num_chunks + 3;
  std::vector<int64_t> pool_id(tree.capacity);  // chunk ids in random pool order
  for (int i = 0; i < tree.capacity; ++i) pool_id[i] = i;
  for (int i = tree.capacity - 1; i > 0; --i) std::swap(pool_id[i], pool_id[rng.uniform(0, i)]);
  for (int leaf : leaves) {
    std::vector<int> path;
    for (int x = leaf; x > 0; x = nodes[x].parent) path.push_back(x);
    std::reverse(path.begin(), path.end());
    std::vector<Segment> segments;
    int64_t pos = 0;
    for (int x : path) {
      const Node& nd = nodes[x];
      const int64_t len = static_cast<int64_t>(nd.tokens.size());
      Segment* last = segments.empty() ? nullptr : &segments.back();
      if (last != nullptr && last->chunk == pool_id[nd.chunk] && last->users == nd.users)
        last->len += len;  // the same users: one run of slots (an in-place child starts at the parent's end)
      else
        segments.push_back({pool_id[nd.chunk], nd.start, len, pos, nd.users});
      pos += len;
    }
    tree.paths.push_back(segments);
  }
  return tree;
}

// (chunk, slot) of each position of a sequence, through its segments: where the
// references read its own keys.
inline std::vector<std::pair<int64_t, int64_t>> key_slots(const std::vector<Segment>& segments) {
  std::vector<std::pair<int64_t, int64_t>> slots;
  for (const Segment& s : segments)
    for (int64_t j = 0; j < s.len; ++j) slots.push_back({s.chunk, s.start + j});
  return slots;
}

// The pool's K and V, [capacity + 1][num_kv_heads][chunk_size][head_dim]: random values
// in the slots some segment holds and NaN in every other one (behind a segment's end
// inside a chunk, the spare chunks), so a kernel that reads one into a result fails. The
// extra chunk behind the last is the guard a kernel's key tile may read into (params.h:
// kGuardRows), NaN too.
template <typename T, typename ToStorage>
void fill_pool(const Tree& tree, int num_kv_heads, int chunk_size, int head_dim, Rng& rng, ToStorage to_storage,
               std::vector<T>& k, std::vector<T>& v) {
  const int64_t rows = static_cast<int64_t>(tree.capacity + 1) * num_kv_heads * chunk_size;
  k.assign(rows * head_dim, to_storage(std::nanf("")));
  v = k;
  std::vector<bool> used(static_cast<size_t>(tree.capacity) * chunk_size);
  for (const auto& path : tree.paths)
    for (const auto& [chunk, slot] : key_slots(path)) used[chunk * chunk_size + slot] = true;
  for (int64_t chunk = 0; chunk < tree.capacity; ++chunk)
    for (int h = 0; h < num_kv_heads; ++h)
      for (int slot = 0; slot < chunk_size; ++slot) {
        if (!used[chunk * chunk_size + slot]) continue;
        const int64_t row = (chunk * num_kv_heads + h) * chunk_size + slot;
        for (int d = 0; d < head_dim; ++d)
          k[row * head_dim + d] = to_storage(rng.value()), v[row * head_dim + d] = to_storage(rng.value());
      }
}
