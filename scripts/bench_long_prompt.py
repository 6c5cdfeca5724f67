"""Long prompts on the default model: prefill time, peak memory and the latency of
the requests decoding meanwhile (chunked prefill).

    python scripts/bench_long_prompt.py --n-prompt 8000 --budgets 512 1024 2048

In one process, fp32, on one prompt of `--n-prompt` tokens (the shipped tool
manual, repeated):
  stock      the model's forward over the prompt with a `DynamicCache` (what
             `generate` runs before its first token)
  engine B   the engine's time to that prompt's first token, alone, with
             `max_prefill_tokens=B` for each B of `--budgets`
  latency B  a short request decodes while the long prompt is admitted: its worst
             gap between two tokens, against the long prompt's time to first token
Memory: the peak resident-set growth during each run (sampled every 2 ms), minus the
K/V it holds, i.e. what a run needs beyond weights and cache.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import gc
import json
import platform
import threading
import time

import psutil
import torch
from bench_e2e import build_prompts
from transformers import DynamicCache, GenerationConfig

import chunk_llama
from chunk_llama import ChunkLlamaEngine
from chunk_llama.gguf.weights import gguf_blocks

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if platform.system() == "Linux" else None


class PeakRss:
    """Peak resident-set growth over a `with` block, sampled in a thread."""

    def __enter__(self):
        gc.collect()
        if _LIBC is not None:  # hand freed heap back to the OS, or a run reuses it unseen
            _LIBC.malloc_trim(0)
        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def kv_bytes(config, num_tokens: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * num_tokens


@torch.no_grad()
def run_stock(model, prompt: list[int]) -> dict:
    with PeakRss() as rss:
        start = time.perf_counter()
        model(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
        seconds = time.perf_counter() - start
    return dict(seconds=seconds, extra_mib=(rss.growth - kv_bytes(model.config, len(prompt))) / 2**20)


def make_engine(model, budget: int) -> ChunkLlamaEngine:
    return ChunkLlamaEngine(model, max_batch_size=4, max_prefill_tokens=budget, retain_prefixes=False)


def run_engine(model, prompt: list[int], budget: int) -> dict:
    engine = make_engine(model, budget)
    config = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None)
    with PeakRss() as rss:
        start = time.perf_counter()
        engine.generate([prompt], config)
        seconds = time.perf_counter() - start
    held = engine.stats["peak_kv_bytes"]
    engine.close()
    return dict(seconds=seconds, extra_mib=(rss.growth - held) / 2**20)


def run_latency(model, prompt: list[int], short: list[int], budget: int) -> dict:
    """Worst inter-token gap of a decoding request while `prompt` is admitted."""
    engine = make_engine(model, budget)
    decode_all_along = GenerationConfig(max_new_tokens=model.config.max_position_embeddings - len(short), do_sample=False,
                                        eos_token_id=None)
    running = engine.add_request(short, decode_all_along)
    engine.step()
    engine.step()
    last = time.perf_counter()
    arrival = last
    long_id = engine.add_request(prompt, GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None))
    gaps, first_token = [], None
    while first_token is None:
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.request_id == running and delta.token_ids:
                gaps.append(now - last)
                last = now
            if delta.request_id == long_id and delta.token_ids:
                first_token = now - arrival
    engine.close()
    return dict(worst_gap=max(gaps), ttft=first_token, ratio=max(gaps) / first_token, num_steps=len(gaps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-prompt", type=int, default=8000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()

    model, tokenizer = chunk_llama.load_default_model()
    torch.set_num_threads(torch.get_num_threads())
    prompt = build_prompts(tokenizer, 0, args.n_prompt, 1)[0]
    short = build_prompts(tokenizer, 0, 64, 2)[1]
    backend = chunk_llama.ops.backend_info(model.device, model.dtype, 64, 64)
    # both systems run the same weights: the GGUF blocks where they run ("stock forward" is transformers'
    # forward on them, not on its own float32 load)
    blocks = ", ".join(f"{n} {t}" for t, n in sorted(gguf_blocks(model).items())) or "none"
    print(f"# {len(prompt)}-token prompt, default model, fp32, GGUF blocks: {blocks}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, decode backend {backend['backend']}:{backend['isa']}, "
          f"{datetime.date.today()}")
    run_stock(model, prompt[:256])  # warm-up: first-touch of weights and thread pools
    run_engine(model, prompt[:256], args.budgets[0])
    rows = []
    for _ in range(args.repeat):
        stock = run_stock(model, prompt)
        rows.append(dict(system="stock forward", **stock))
        print(f"stock forward: {stock['seconds']:.2f} s, {stock['extra_mib']:.0f} MiB beyond weights and K/V")
        for budget in args.budgets:
            engine = run_engine(model, prompt, budget)
            latency = run_latency(model, prompt, short, budget)
            rows.append(dict(system=f"engine {budget}", **engine, **latency))
            print(f"engine, max_prefill_tokens={budget}: {engine['seconds']:.2f} s "
                  f"({engine['seconds'] / stock['seconds']:.2f}x stock), {engine['extra_mib']:.0f} MiB "
                  f"({engine['extra_mib'] / max(stock['extra_mib'], 1e-9):.2f}x stock); while admitted, a decoding "
                  f"request's worst gap {latency['worst_gap']:.2f} s = {latency['ratio']:.2f} of the prompt's "
                  f"time to first token ({latency['ttft']:.2f} s, {latency['num_steps']} steps)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
