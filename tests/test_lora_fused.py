"""Per-request LoRA inside the CPU's fused decoder layers (`csrc/cpu/lora.cpp`,
`hf/fused/lora.py`): a step whose rows run under several adapters and the base runs the fused
calls (no longer op by op), each request still gets stock PEFT's answer under its adapter
alone, and a request's logits do not depend on which adapters share its steps, the base's
included; at the layer, the deltas the C call adds equal `add_lora_deltas`' (the op-by-op
path) to float32's rounding at odd row counts, base rows untouched, and a factor of the
wrong shape is a ValueError naming it before anything is written."""

from __future__ import annotations

import pytest
import torch
from families import FUSED_MODELS, tiny_model
from helpers import make_tree
from test_lora import CONFIG, check_against_stock, engine_for, mixed_batch, setup  # noqa: F401 (fixture)
from test_lora_ops import float32_bound
from tolerances import assert_close

from chunk_llama.hf.fused.describe import describe
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu import linear as linear_ops
from chunk_llama.ops.cpu import lora as lora_ops
from chunk_llama.ops.cpu.attention import CpuDecode, build
from chunk_llama.ops.cpu.planned import CpuPlanned
from chunk_llama.ops.cpu.structs import DecoderLayer
from chunk_llama.ops.lora import LoraFactors, LoraRows, add_lora_deltas
from chunk_llama.step import StaticBuffers, build_decode_plan

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(build() is None or isa.host_arch() != "x86_64",
                                reason="the fused layer runs with the CPU kernels' linear path (x86-64)")


@pytest.fixture
def fused_calls(monkeypatch):
    """Spies on the fused C calls: [(rows, segments under adapters)] per call."""
    calls = []
    layer_call, stack_call = CpuPlanned.decoder_layer, CpuPlanned.decoder_stack

    def spy(self, layer, hidden, *args, **kwargs):
        lora = kwargs.get("lora", args[6] if len(args) > 6 else None)  # (after cos, sin, pools, scale, window)
        calls.append((hidden.shape[0], 0 if lora is None else lora.num_segments))
        return layer_call(self, layer, hidden, *args, **kwargs)

    def stack_spy(self, stack, hidden, cos, sin, lora=None):
        calls.append((hidden.shape[0], 0 if lora is None else lora.num_segments))
        return stack_call(self, stack, hidden, cos, sin, lora)

    monkeypatch.setattr(CpuPlanned, "decoder_layer", spy)
    monkeypatch.setattr(CpuPlanned, "decoder_stack", stack_spy)
    return calls


def test_a_mixed_batch_of_four_adapters_and_the_base_runs_the_fused_layers(setup, fused_calls):  # noqa: F811
    _, _, stock, _ = setup
    engine = engine_for(setup)
    prompts, names = mixed_batch(6)
    outputs = engine.generate(prompts, CONFIG, adapter=names)
    # prefills and decode steps alike ran in the fused calls with the adapters' rows in them
    assert fused_calls and all(segments for _, segments in fused_calls), fused_calls
    assert any(rows > len(prompts) for rows, _ in fused_calls) and any(rows == len(prompts) for rows, _ in fused_calls)
    check_against_stock(stock, prompts, names, outputs)


@pytest.mark.parametrize("name", [None, "c"])
def test_a_requests_logits_do_not_depend_on_the_adapters_beside_it(setup, name, fused_calls):  # noqa: F811
    """The base's (which ran op by op beside adapters before) and an adapter's: bit for bit."""
    prompts, names = mixed_batch(7)
    index = names.index(name)
    alone = engine_for(setup).generate([prompts[index]], CONFIG, adapter=name)[0].logits
    assert fused_calls and all(bool(segments) == (name is not None) for _, segments in fused_calls)
    together = engine_for(setup).generate(prompts, CONFIG, adapter=names)[index].logits
    assert torch.equal(together, alone)
    # beside other adapters only (no base row in the batch)
    others = [i for i, n in enumerate(names) if n not in (None, name)][:6] + [index]
    beside = engine_for(setup).generate([prompts[i] for i in others], CONFIG, adapter=[names[i] for i in others])
    assert torch.equal(beside[-1].logits, alone)


class Adapter:
    """What `LoraRows` segments hold: factors by module key."""

    def __init__(self, factors):
        self._factors = factors

    def factors(self, key):
        return self._factors.get(key, ())


def _factors(rank: int, in_features: int, out_features: int, seed: int, scaling: float) -> LoraFactors:
    g = torch.Generator().manual_seed(seed)
    return LoraFactors(torch.randn(rank, in_features, generator=g) * 0.3,
                       torch.randn(out_features, rank, generator=g) * 0.3, scaling)


def _decode_step(rows: int, head_dim: int, heads: int, kv_heads: int):
    """A decode step of `rows` sequences over a fresh pool: (pool, planned, each row's K/V slot)."""
    pool, tree = make_tree([[6 + s % 80, 7 + s] for s in range(rows)], chunk_size=16, num_kv_heads=kv_heads,
                           head_dim=head_dim, spare_chunks=2)
    seq_ids = list(range(rows))
    chunks, offsets = tree.append(seq_ids, [9] * rows)
    plan = build_decode_plan(tree, seq_ids)
    slot = dict(zip(seq_ids, zip(chunks, offsets)))
    slots = [slot[s] for s in plan.seq_ids]  # plan row r writes its sequence's new slot
    writes = (torch.arange(rows), torch.tensor([c for c, _ in slots]), torch.tensor([o for _, o in slots]))
    planned = CpuDecode(StaticBuffers("cpu"), heads, kv_heads, head_dim, 16).plan(plan, pool.capacity, writes)
    return pool, planned, slots


@pytest.mark.parametrize("rows, cuts", [(17, (0, 5, 9, 17)), (37, (0, 17, 17, 37))])
def test_the_fused_layer_adds_what_add_lora_deltas_adds(rows, cuts):
    """K and V as the fused layer stores them, where the input norm is exact (rows of +-1, a
    weight of ones, eps 0) and the rotation is the identity (cos 1, sin 0): each projection
    plus its rows' deltas, against the op-by-op path on the same projections."""
    layer = tiny_model(FUSED_MODELS, "llama").model.layers[0]
    described = describe(layer)
    hidden, head_dim, kv_width = described.hidden_size, described.head_dim, layer.self_attn.k_proj.out_features
    struct = DecoderLayer.from_buffer_copy(described.struct)
    ones = torch.ones(hidden)
    struct.norm_eps, struct.input_norm = 0.0, ones.data_ptr()
    first = Adapter({"k": (_factors(4, hidden, kv_width, 1, 2.0),), "v": (_factors(16, hidden, kv_width, 2, 0.5),)})
    # two factors on one module (PEFT's active adapters together), and one target only
    second = Adapter({"v": (_factors(7, hidden, kv_width, 3, 0.25), _factors(32, hidden, kv_width, 4, 1.5))})
    lora = LoraRows.from_runs([(cuts[0], cuts[1], first), (cuts[1], cuts[2], None), (cuts[2], cuts[3], second)],
                              rows)
    targets = ((None, 0, 0, 0), ("k", 0, kv_width, kv_width), ("v", 0, kv_width, kv_width), *((None, 0, 0, 0),) * 4)
    step_rows = lora_ops.step_rows(lora.segments, (targets,))
    x = torch.randint(0, 2, (rows, hidden), generator=torch.Generator().manual_seed(rows)).float() * 2 - 1
    cos, sin = torch.ones(rows, head_dim), torch.zeros(rows, head_dim)
    pool, planned, slots = _decode_step(rows, head_dim, described.struct.num_heads, struct.num_kv_heads)
    planned.decoder_layer(struct, x, cos, sin, pool.k[0], pool.v[0], described.scale, 0, step_rows, 0)
    linear = linear_ops.resolve(torch.float32, "cpu")
    for key, cache, weight in (("k", pool.k[0], layer.self_attn.k_proj.weight),
                               ("v", pool.v[0], layer.self_attn.v_proj.weight)):
        stored = torch.stack([cache[c, :, o].reshape(-1) for c, o in slots])  # [rows, kv_width]
        base = linear(x, weight.detach(), None)
        op_by_op = add_lora_deltas(base.clone(), x, lora, key, linear)
        assert torch.equal(stored[cuts[1]:cuts[2]], base[cuts[1]:cuts[2]]), key  # the base's rows untouched
        for start, end, adapter in lora.segments:
            bound = float32_bound(x[start:end], base[start:end], adapter.factors(key))
            # both within float32's rounding of the same sum: of each other by twice that
            assert_close(stored[start:end], op_by_op[start:end], atol=2 * bound, what=f"{key} rows {start}:{end}")


def test_a_factor_of_the_wrong_shape_is_a_value_error_naming_it():
    layer = tiny_model(FUSED_MODELS, "llama").model.layers[0]
    described = describe(layer)
    hidden, head_dim = described.hidden_size, described.head_dim
    kv_width = layer.self_attn.v_proj.out_features
    wrong = Adapter({"v": (_factors(4, hidden, kv_width + 1, 1, 1.0),)})  # v_proj maps to kv_width
    targets = (*((None, 0, 0, 0),) * 2, ("v", 0, kv_width, kv_width), *((None, 0, 0, 0),) * 4)
    step_rows = lora_ops.step_rows(LoraRows.from_runs([(1, 3, wrong)], 3).segments, (targets,))
    pool, planned, _ = _decode_step(3, head_dim, described.struct.num_heads, described.struct.num_kv_heads)
    before = (pool.k.clone().nan_to_num(), pool.v.clone().nan_to_num())
    x, cos = torch.randn(3, hidden), torch.ones(3, head_dim)
    with pytest.raises(ValueError, match=rf"a factor of v_proj maps {hidden} -> {kv_width + 1} features with rank "
                                         rf"4, the layer's v_proj {hidden} -> {kv_width}"):
        planned.decoder_layer(described.struct, x, cos, cos, pool.k[0], pool.v[0], 1.0, 0, step_rows, 0)
    assert torch.equal(pool.k.nan_to_num(), before[0]) and torch.equal(pool.v.nan_to_num(), before[1])
    with pytest.raises(ValueError, match="its table of 1 layers has no layer 1"):
        planned.decoder_layer(described.struct, x, cos, cos, pool.k[0], pool.v[0], 1.0, 0, step_rows, 1)
    # factors the C code cannot read in place make no table: the reason, for the layers to step aside
    half = Adapter({"v": (LoraFactors(torch.zeros(4, hidden, dtype=torch.bfloat16), torch.zeros(kv_width, 4), 1.0),)})
    assert "bfloat16" in lora_ops.step_rows(LoraRows.from_runs([(0, 3, half)], 3).segments, (targets,))


def test_a_stack_with_adapters_in_one_call_equals_its_layers_own_calls(setup):  # noqa: F811
    """The stack's one call and each layer's own (CHUNK_LLAMA_FUSED_STACK=0): bit for bit."""
    prompts, names = mixed_batch(8)
    stacked = engine_for(setup).generate(prompts, CONFIG, adapter=names)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHUNK_LLAMA_FUSED_STACK", "0")
        alone = engine_for(setup).generate(prompts, CONFIG, adapter=names)
    for a, b in zip(stacked, alone):
        assert torch.equal(a.logits, b.logits)


def test_the_op_by_op_path_still_adds_the_deltas_where_the_layers_do_not_fuse(setup, monkeypatch):  # noqa: F811
    _, _, stock, _ = setup
    monkeypatch.setenv("CHUNK_LLAMA_FUSED_LAYERS", "0")
    prompts, names = mixed_batch(9)
    check_against_stock(stock, prompts, names, engine_for(setup).generate(prompts, CONFIG, adapter=names))
