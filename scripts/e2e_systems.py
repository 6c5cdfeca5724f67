"""The serving systems `bench_e2e.py` compares, each replaying the same arrivals.

Each `run_*` takes the model, the prompts (token ids), their arrival offsets in
seconds (all 0 for "all at once") and a greedy `GenerationConfig`, and returns one
record per request: tokens, arrival, first-token and finish times (perf_counter),
plus the system's peak KV bytes and batch size where it can tell.
"""

from __future__ import annotations

import copy
import random
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList

from chunk_llama import ChunkLlamaEngine
from chunk_llama.eval.parity import stock_generate_tokens, trim_at_eos
from chunk_llama.hf.generate import stock_generate

# Real models' attention and MLP shapes (their published configs), for random-weight runs.
GEOMETRIES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
}
QUESTION_TOKENS = 24


def random_weight_model(geometry: str, dtype: torch.dtype, device: str, seed: int):
    """A Llama model of `geometry`'s shapes, random weights (std 0.1, not transformers' 0.02:
    near-uniform logits would make greedy decoding a string of near-ties in half
    precision, where any two correct kernels part ways), no EOS (every request runs to
    its token budget)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**GEOMETRIES[geometry], max_position_embeddings=8192, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0, initializer_range=0.1)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def random_prompts(vocab_size: int, n_shared: int, num_requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(n_shared)]
    return [shared + [rng.randrange(3, vocab_size) for _ in range(QUESTION_TOKENS)] for _ in range(num_requests)]


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(model, prompts, arrivals, config, max_batch_size=32, chunk_size=64, kv_dtype="auto",
               enforce_eager=False):
    """This engine through its online API: requests join at their arrival time (made, and on a GPU
    its decode steps captured, before the clock starts)."""
    engine = ChunkLlamaEngine(model, max_batch_size=max_batch_size, chunk_size=chunk_size, kv_dtype=kv_dtype,
                              enforce_eager=enforce_eager)
    start = time.perf_counter()
    records = [dict(arrival=start + a) for a in arrivals]
    request_of = {}
    next_arrival = 0
    while next_arrival < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_arrival < len(prompts) and records[next_arrival]["arrival"] <= now:
            request_of[engine.add_request(prompts[next_arrival], config)] = next_arrival
            next_arrival += 1
        if not engine.has_unfinished_requests():
            _wait_until(records[next_arrival]["arrival"])
            continue
        for delta in engine.step():
            if delta.finished:
                out = delta.output
                records[request_of[delta.request_id]].update(
                    tokens=out.token_ids, first_token=out.first_token_time, finish=out.finish_time
                )
    stats = engine.stats
    return records, dict(peak_kv_bytes=stats["peak_kv_bytes"], peak_batch_size=stats["peak_batch_size"],
                         attention_backend=stats["attention_backend"], decode_graph_steps=stats["decode_graph_steps"])


class _FirstCallTimer(LogitsProcessor):
    """Records when `generate` picks its first token (its time to first token)."""

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        self.first = self.first or time.perf_counter()
        return scores


def run_stock(model, prompts, arrivals, config, max_batch_size=32, pad_id=0):
    """Stock `model.generate` on static left-padded batches: whenever it is idle, it
    takes every request that has arrived (up to the batch size) and runs them to the end."""
    start = time.perf_counter()
    records = [dict(arrival=start + a) for a in arrivals]
    peak_kv = peak_batch = 0
    served = 0
    while served < len(prompts):
        _wait_until(records[served]["arrival"])
        now = time.perf_counter()
        batch = [i for i in range(served, min(len(prompts), served + max_batch_size)) if records[i]["arrival"] <= now]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad_id] * (width - len(prompts[i])) + prompts[i] for i in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch],
                            device=model.device)
        timer = _FirstCallTimer()
        with torch.no_grad():
            out = stock_generate(model, input_ids=ids, attention_mask=mask, generation_config=config,
                                 logits_processor=LogitsProcessorList([timer]), return_dict_in_generate=True)
        finish = time.perf_counter()
        cache = out.past_key_values
        peak_kv = max(peak_kv, sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)))
        peak_batch = max(peak_batch, len(batch))
        for row, i in enumerate(batch):
            records[i].update(tokens=trim_at_eos(out.sequences[row, width:].tolist(), config.eos_token_id),
                              first_token=timer.first, finish=finish)
        served += len(batch)
    return records, dict(peak_kv_bytes=peak_kv, peak_batch_size=peak_batch)


def run_generate_batch(model, prompts, arrivals, config, block_sharing: bool):
    """transformers' continuous batching (the manager behind `generate_batch`),
    with prefix block sharing on or off; requests are added at their arrival time."""
    cb_config = ContinuousBatchingConfig(allow_block_sharing=block_sharing)
    gen_config = copy.deepcopy(config)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    start = time.perf_counter()
    records = [dict(arrival=start + a) for a in arrivals]
    index_of = {}
    try:
        for i, prompt in enumerate(prompts):
            if arrivals[i] > 0:
                _wait_until(records[i]["arrival"])
            request_id = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=config.max_new_tokens,
                                             record_timestamps=True)
            index_of[request_id] = i
            while (result := manager.get_result(timeout=0)) is not None:
                _record_cb(records, index_of, result)
        while sum("finish" in r for r in records) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None:
                _record_cb(records, index_of, result)
            elif not manager.is_running():
                raise RuntimeError("generate_batch's loop stopped")
    finally:
        manager.stop(block=True, timeout=10)
        model.destroy_cached_continuous_batching_manager()
    return records, dict(peak_kv_bytes=None, peak_batch_size=None)


def _record_cb(records, index_of, result):
    if not result.is_finished():
        return
    if result.error:
        raise RuntimeError(f"generate_batch request {result.request_id} failed: {result.error}")
    records[index_of[result.request_id]].update(
        tokens=list(result.generated_tokens),
        first_token=result.timestamps[0] if result.timestamps else None,
        finish=time.perf_counter(),
    )


def per_request_reference(model, prompts, config) -> list[list[int]]:
    """Stock `generate` one request at a time: the greedy tokens every system must match."""
    return [stock_generate_tokens(model, prompt, config, config.eos_token_id) for prompt in prompts]


def greedy_config(model, max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
