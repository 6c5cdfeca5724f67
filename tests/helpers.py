"""Shared helpers for tests: random prefix trees and dense attention oracles."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from tolerances import assert_kernel_close

from chunk_llama.hf.generate import stock_generate
from chunk_llama.kv import ChunkPool, PrefixTree


def random_token_lists(rng: random.Random, num_seqs: int, max_len: int, vocab: int = 50) -> list[list[int]]:
    """Sequences that branch off one another at random points (a random tree)."""
    seqs: list[list[int]] = []
    for _ in range(num_seqs):
        length = rng.randint(1, max_len)
        if seqs and rng.random() < 0.8:
            parent = rng.choice(seqs)
            keep = rng.randint(0, min(len(parent), length))
            seq = parent[:keep] + [rng.randrange(vocab) for _ in range(length - keep)]
        else:
            seq = [rng.randrange(vocab) for _ in range(length)]
        seqs.append(seq)
    return seqs


def make_tree(
    token_lists: list[list[int]],
    *,
    chunk_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    seed: int = 0,
    device: str = "cpu",
    spare_chunks: int = 1,
    token_granular: bool = True,
    remove: tuple[int, ...] = (),
) -> tuple[ChunkPool, PrefixTree]:
    """A tree holding `token_lists` as sequences 0..n-1 but those in `remove` (inserted, then
    removed: the others keep the nodes split where they parted), pool filled with random
    K/V (slots of no node hold NaN, so a kernel that reads them into a result fails)."""
    capacity = sum(-(-len(t) // chunk_size) for t in token_lists) + spare_chunks
    pool = ChunkPool(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        chunk_size=chunk_size,
        capacity=capacity,
        dtype=dtype,
        device=device,
    )
    generator = torch.Generator().manual_seed(seed)
    tree = PrefixTree(pool, token_granular=token_granular)
    for seq_id, tokens in enumerate(token_lists):
        tree.insert(seq_id, tokens)
    for seq_id in remove:
        tree.remove(seq_id)
    written = torch.zeros(pool.capacity, chunk_size, dtype=torch.bool)
    for node in tree.nodes():
        written[node.chunk_id, node.start : node.end] = True
    for cache in (pool.k, pool.v):
        values = torch.randn(cache.shape, generator=generator).to(dtype)
        cache.copy_(values.masked_fill(~written[None, :, None, :, None], float("nan")))
    return pool, tree


def dense_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [num_heads, head_dim]; k, v: [num_kv_heads, length, head_dim] -> [num_heads, head_dim]."""
    out = F.scaled_dot_product_attention(
        q.float()[None, :, None, :],
        k.float()[None],
        v.float()[None],
        scale=scale,
        enable_gqa=k.shape[0] != q.shape[0],
    )
    return out[0, :, 0, :]


def run_planned(library, kind: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                index: torch.Tensor, layout, scratch: torch.Tensor, scale: float, window: int, isa: str,
                max_blocks_per_item: int = 0) -> torch.Tensor:
    """One attention call of the CPU library as a step makes it: the plan (index, layout)
    made once in a new handle for q's rows and the pool, with `scratch`, then run."""
    geometry = (q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2], k_cache.shape[2])
    planned = library.new_plan().make(kind, index, layout, geometry, k_cache.shape[0], lambda floats: scratch, isa,
                                      max_blocks_per_item=max_blocks_per_item)
    return planned.run(q, k_cache, v_cache, scale, window)


def tiny_llama(*, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0, init=0.2, eos=5, num_layers=2,
               max_position_embeddings=512, **overrides):
    """A small random Llama (2 layers by default) whose logits are far from ties (large
    init), so greedy decoding is stable under float reordering."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=num_heads * head_dim,
        head_dim=head_dim,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init,
        eos_token_id=eos,
        bos_token_id=1,
        pad_token_id=0,
        **overrides,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def assert_decode_matches(out, q, pool, tree, plan, scale, *, reference_out=None, rounded_operand_scale=None):
    """out [num_seqs, H, D] (plan order) against dense SDPA on each sequence's own K/V and,
    when given, against the reference's output, within the dtype's kernel tolerance
    (`tolerances.assert_kernel_close`); NaN never passes."""
    from chunk_llama.ops.reference import gather_dense

    if reference_out is not None:
        assert_kernel_close(out, reference_out.float(), "against the reference", rounded_operand_scale)
    for row, seq_id in enumerate(plan.seq_ids):
        segments, length = tree.segments(seq_id), tree.seq_len(seq_id)
        dense = dense_decode_reference(
            q[row], gather_dense(pool.k[0], segments, length), gather_dense(pool.v[0], segments, length), scale
        )
        assert_kernel_close(out[row], dense, f"sequence {seq_id} against dense SDPA", rounded_operand_scale)


def check_native_kernel(tokens, *, backend, chunk_size, num_kv_heads, group, head_dim, dtype, seed=0, device="cpu",
                        remove=()):
    """Run a native decode kernel on a tree of `tokens` and check it against the reference
    and dense SDPA; `backend` is the one `decode_backend` must pick. Returns the plan."""
    from chunk_llama.ops import decode_backend, reference, tpp_decode_attention
    from chunk_llama.step import build_decode_plan

    # the CUDA kernels take whole-chunk plans only (the CUDA cache shares by whole chunks)
    pool, tree = make_tree(tokens, chunk_size=chunk_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           dtype=dtype, seed=seed, device=device, token_granular=backend != "cuda", remove=remove)
    plan = build_decode_plan(tree, tree.seq_ids, device=device, group=group)
    assert plan.aligned or backend != "cuda"
    q = torch.randn(plan.num_seqs, num_kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    scale = head_dim**-0.5
    assert decode_backend(q, pool.k[0], plan) == backend
    out = tpp_decode_attention(q, pool.k[0], pool.v[0], plan, scale)
    assert out.dtype == dtype
    ref = reference.tpp_decode_attention(q, pool.k[0], pool.v[0], plan, scale)
    # the CUDA kernels round P for the P V product on tensor cores (the largest |V| bounds it)
    operand_scale = pool.v.nan_to_num(0).abs().max().item() if backend == "cuda" else None
    assert_decode_matches(out, q, pool, tree, plan, scale, reference_out=ref, rounded_operand_scale=operand_scale)
    return plan


def tiny_tokenizer():
    """A word-level tokenizer for `tiny_llama`'s 96 ids: token i is the word `w{i}`,
    decoded with spaces between words; `w5` is EOS (a special token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w5", unk_token="w0")


def fail_next_forward(model, exception=RuntimeError, layer: int = 1):
    """Make the next forward of decoder layer `layer` raise `exception("injected")`, once."""

    def fail(module, args, output):
        handle.remove()
        raise exception("injected")

    handle = model.model.layers[layer].register_forward_hook(fail)


def stock_greedy(model, prompt: list[int], config) -> list[int]:
    """Stock transformers `generate` for one prompt; the new tokens."""
    with torch.no_grad():
        out = stock_generate(model, 
            torch.tensor([prompt]), generation_config=config, attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
        )
    return out[0, len(prompt) :].tolist()


def assert_tree_consistent(tree) -> None:
    """The tree's invariants, checked from outside: each node's count is the number of live
    sequences through it; a node no sequence uses is kept only with retention, and its
    chunk is retained when no node of the chunk is used; each chunk's nodes are one chain
    from slot 0 (each in-place child starts where its parent ends); children are indexed
    by their first token; no two nodes hold the same slot; every chunk is in the tree or
    free, never both."""
    pool = tree.pool
    users: dict[int, int] = {}
    for seq_id in tree.seq_ids:
        for node in tree.path(seq_id):
            users[id(node)] = users.get(id(node), 0) + 1
    nodes = tree.nodes()
    heads = {}
    slots = [(node.chunk_id, slot) for node in nodes for slot in range(node.start, node.end)]
    assert len(slots) == len(set(slots))  # no slot holds two nodes' tokens
    for node in nodes:
        assert node.num_seqs == users.get(id(node), 0)
        assert 0 <= node.start < node.end <= pool.chunk_size
        assert tree.retain_prefixes or node.num_seqs > 0
        if node.start == 0:
            assert node.chunk_id not in heads
            heads[node.chunk_id] = node
            assert tree.is_retained(node.chunk_id) == (node.num_seqs == 0)
        else:
            assert node.parent.chunk_id == node.chunk_id and node.parent.end == node.start
        assert node.parent.children[node.key] is node and node in node.parent.by_token[node.tokens[0]]
    for seq_id in tree.seq_ids:  # a path runs from its key's root
        path = tree.path(seq_id)
        assert not path or path[0].parent is tree.roots()[tree.keys().index(tree.key_of(seq_id))]
    assert all(root.children for root in tree.roots()[1:])  # an emptied key's root goes
    for node in [*tree.roots(), *nodes]:
        assert sum(len(v) for v in node.by_token.values()) == len(node.children)
        assert sum(child.chunk_id == node.chunk_id for child in node.children.values()) <= 1
    assert tree.num_retained == sum(1 for head in heads.values() if head.num_seqs == 0)
    free = {c for c in range(pool.capacity) if pool.is_free(c)}
    assert len(free) == pool.num_free
    assert set(heads).isdisjoint(free) and set(heads) | free == set(range(pool.capacity))


def token_granular_chunks(token_lists, chunk_size):
    """Chunks a token-granular prefix tree needs for these sequences inserted in order,
    modelled token by token: each distinct prefix is held once, in the slot behind its
    parent's when that slot is in the same chunk and not taken yet, else at the start of
    a fresh chunk."""
    slot_of: dict[tuple, tuple[int, int]] = {}
    taken: set[tuple[int, int]] = set()
    num_chunks = 0
    for tokens in token_lists:
        for end in range(1, len(tokens) + 1):
            prefix = tuple(tokens[:end])
            if prefix in slot_of:
                continue
            parent = slot_of.get(prefix[:-1])
            behind = (parent[0], parent[1] + 1) if parent else None
            if behind is None or behind[1] == chunk_size or behind in taken:
                behind, num_chunks = (num_chunks, 0), num_chunks + 1
            slot_of[prefix] = behind
            taken.add(behind)
    return num_chunks


def tree_snapshot(tree) -> dict:
    """Everything a rolled-back step must restore: sequences and their segments, every node
    with its slots, tokens and count, LRU order, counters."""
    pool = tree.pool
    return dict(
        seqs={s: (tree.segments(s), tree.tokens(s), tree.key_of(s)) for s in tree.seq_ids},
        keys=tree.keys(),
        nodes=sorted((n.key, n.parent.key, tuple(n.tokens), n.num_seqs) for n in tree.nodes()),
        retained=tree.retained_ids(),
        free=sorted(c for c in range(pool.capacity) if pool.is_free(c)),
        counters=(tree.num_revived, tree.num_evicted, tree.peak_live_chunks, pool.peak_used),
    )


def tiny_bpe_tokenizer():
    """A byte-level BPE tokenizer with 96 ids (for `tiny_llama`), trained here on a few
    sentences: unlike `tiny_tokenizer`, stock `generate`'s stop-string matching can read it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the quick brown fox jumps over the lazy dog", "abcdef ghijkl mnopqr stuvwx yz stop here then go",
              "tool call: weather(city) observation: sunny"] * 5
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=96, special_tokens=["<pad>", "<bos>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def tiny_byte_tokenizer():
    """A byte-level BPE tokenizer that can write any text (JSON, tool calls): the 256 bytes,
    `<pad>`, `<bos>`, `<eos>` (id 2) and merges learnt from a few JSON-like lines, 320 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ['{"city": "Paris", "unit": "celsius", "days": 3}', '<tool_call>\n{"name": "get_weather", '
              '"arguments": {}}\n</tool_call>', "the weather in Boston is sunny", "Action: Tool[a, b]"] * 5
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def tiny_byte_llama(tokenizer, seed=0, **kwargs):
    """`tiny_llama` with `tokenizer`'s vocabulary (EOS = its eos id), embeddings drawn anew."""
    model = tiny_llama(eos=tokenizer.eos_token_id, seed=seed, **kwargs)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return model


def tiny_sentencepiece_tokenizer():
    """A SentencePiece-style BPE tokenizer as Gemma's is built: "▁" for a space, the 256
    byte-fallback tokens `<0x00>`..`<0xFF>` for what the vocabulary lacks (any non-ASCII
    character here), a few merges; `</s>` (id 2) is EOS, 291 ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in '▁abcdefghijklmnopqrstuvwxyz"{}:,':
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<unk>", "<s>", "</s>"]})
    return tokenizer
