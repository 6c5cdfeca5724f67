"""`ChunkLlamaEngine`: iteration-level batching over the prefix-aware cache.

Offline use is `generate(prompts)`. Online use is `add_request`, `step()` in a
loop, `abort` and `stream`.

Threads: every entry point may be called from any number of threads at once. One
iteration runs at a time (the step lock). `add_request` and `abort` only queue;
`step()` runs an iteration and returns the deltas of requests submitted with
`add_request`; `generate` and `stream` drive iterations themselves (whichever caller
takes the step lock runs one for everyone) and each receives exactly its own
requests' deltas through a private channel. A caller of `generate` or `stream` that
stops early (an exception, `KeyboardInterrupt`, a stream left unfinished) aborts its
own requests; the others go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig

from chunk_llama.engine.adapters import EngineAdapters
from chunk_llama.engine.delivery import Delivery
from chunk_llama.engine.figures import describe, engine_stats
from chunk_llama.engine.graphs import DecodeGraphs
from chunk_llama.engine.inputs import InputProcessor, positive_int
from chunk_llama.engine.request import RequestDelta, RequestOutput, Sequence
from chunk_llama.engine.runner import ModelRunner
from chunk_llama.engine.scheduler import Scheduler
from chunk_llama.gguf.modules import set_gguf_activations
from chunk_llama.gguf.weights import gguf_blocks
from chunk_llama.hf import ChunkCache, is_patched, patch_model
from chunk_llama.hf.lora.registry import AdapterRegistry
from chunk_llama.hf.support import rope_switch_length
from chunk_llama.ops import prepare_backend
from chunk_llama.ops.cpu import linear


class ChunkLlamaEngine(Delivery, EngineAdapters):
    """Serve many prompts on one model, sharing the KV cache of common prefixes.

    Each step admits waiting requests in arrival order (batch and memory
    permitting), prefills them in one packed forward pass computing only the
    tokens after the longest prefix already cached (at most `max_prefill_tokens`
    per step: a longer prompt continues in the next steps), then decodes one token
    for every running sequence. Finished sequences leave at once; with
    `retain_prefixes` their full chunks stay cached until the pool needs room
    (least recently used first), so a later request with the same prefix skips
    its prefill. Generation options are resolved per request exactly as
    transformers' `generate` resolves them (`generation.py`).

    Args:
        model: a transformers causal LM (see `hf.support.check_supported`), patched here if it is not yet.
        tokenizer: needed for text and chat prompts, text deltas and stop strings.
        max_batch_size: most sequences decoded at once.
        chunk_size: tokens per KV chunk (default: the patch's, 64).
        kv_cache_bytes: K/V budget for all layers (default: from free memory).
        kv_dtype: the K/V pool's dtype: "auto" (the model's; float16 where a GGUF model's
            blocks multiply integer activations on the CPU, `gguf_activations`' default) or
            bfloat16 or float16 under a float32 model on the CPU (half the bytes per token;
            attention still in float32).
        max_prefill_tokens: most uncached prompt tokens computed in one step; a
            longer prompt is prefilled in pieces over several steps, between which
            the running requests decode (chunked prefill).
        retain_prefixes: keep the chunks of finished sequences as a prefix cache.
        max_model_len: most tokens of a request, prompt and new tokens together (default and
            at most: the model's `max_position_embeddings`, or where its LongRoPE switches to its
            long factors, `support.rope_switch_length`); `self.max_model_len` is the limit in force.
        lora_modules: LoRA adapters to load, {name: folder PEFT saved} (more with `load_adapter`);
            a PEFT `PeftModel`'s own adapters are known by their PEFT names. A request names
            one with `adapter=` (`engine/adapters.py`).
        max_loras: most loaded adapters whose weights stay in memory at once (the least recently
            used one not in use gives its place; default: all).
        max_lora_rank: largest rank an adapter may have (default: any).
        gguf_activations: what a GGUF model's blocks multiply their inputs with: "auto", "float32",
            "int8" or "int16" (`ops/cpu/activations.py`); None keeps the model's (set by `load_model`).
        enforce_eager: run every decode step eagerly (the default); False: on a GPU, decode steps
            replay CUDA graphs captured here per batch-size bucket (`engine/graphs.py`; the
            start-up logs the time and memory the capture took). Experimental: off by default
            until the capture path is measured on a GPU.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_batch_size: int = 32,
        chunk_size: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_dtype: str | torch.dtype | None = "auto",
        max_prefill_tokens: int = 1024,
        retain_prefixes: bool = True,
        max_model_len: int | None = None,
        lora_modules: dict[str, str] | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        gguf_activations: str | None = None,
        enforce_eager: bool = True,
    ):
        if not isinstance(enforce_eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {type(enforce_eager).__name__}")
        positive_int("max_batch_size", max_batch_size)
        max_positions = getattr(model.config, "max_position_embeddings", None)
        switch = rope_switch_length(model.config)
        if max_model_len is not None:
            positive_int("max_model_len", max_model_len)
            if max_positions and max_model_len > max_positions:
                raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                                 f"max_position_embeddings={max_positions}")
            if switch is not None and max_model_len > switch:
                raise ValueError(f"max_model_len={max_model_len} exceeds {switch}, the length past which this "
                                 "model's LongRoPE turns every key by its long factors (stock generate recomputes "
                                 f"the whole cache there, which a prefix cache does not); use at most {switch}")
        self.max_model_len = max_model_len or (switch if switch is not None else max_positions)
        positive_int("max_prefill_tokens", max_prefill_tokens)
        if chunk_size is not None:
            positive_int("chunk_size", chunk_size)
        if not is_patched(model):
            patch_model(model, chunk_size=chunk_size or 64)
        self.model = model
        if gguf_activations is not None:
            set_gguf_activations(model, gguf_activations)
        self._gguf_blocks = gguf_blocks(model)
        self.tokenizer = tokenizer
        self.adapters = AdapterRegistry(model, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.cache = ChunkCache(
            model,
            chunk_size=chunk_size or model.chunk_llama_chunk_size,
            kv_cache_bytes=kv_cache_bytes,
            kv_dtype=kv_dtype,
            retain_prefixes=retain_prefixes,
            adapters=self.adapters,
        )
        pool, dtype = self.cache.pool, self.cache.geometry.dtype
        # The native kernel is built now (first use only, announced on stderr), not in
        # the first step a user times; a CPU variant this host cannot run fails here.
        prepare_backend(pool.device, dtype, pool.head_dim, pool.chunk_size, pool.dtype)
        linear.backend(dtype, pool.device)  # its one-time check, and why not, logged now
        self.inputs = InputProcessor(model, tokenizer, self.cache.chunk_size, pool.capacity, max_batch_size,
                                     self.max_model_len)
        self._load_adapters(lora_modules)
        self.scheduler = Scheduler(self.cache, max_batch_size, max_prefill_tokens, self.adapters)
        self.runner = ModelRunner(model, self.cache, self.scheduler, self.inputs)
        if not enforce_eager and pool.device.type == "cuda":  # (the CPU's fast path is the fused C stack)
            self.runner.graphs = DecodeGraphs(model, max_batch_size)
            self.runner.graphs.warm_up()
        self.max_batch_size = max_batch_size
        self.device = model.device
        self._init_delivery()

    # ------------------------------------------------------------ online API
    def add_request(self, prompt, generation_config: GenerationConfig | None = None, *, logits_processor=None,
                    stopping_criteria=None, grammar=None, deadline: float | None = None,
                    skip_special_tokens: bool = True, adapter: str | None = None) -> int:
        """Queue a request (thread-safe); returns its id. It is admitted at the next step.

        prompt: a string, a list of chat messages (chat template applied) or token ids.
        generation_config: merged over the model's own, as `generate` does.
        logits_processor, stopping_criteria: extra ones, as `generate` takes them.
        grammar: constrain the output: a `chunk_llama.Grammar` (JSON schema, any JSON object,
            Lark) or OpenAI's `response_format` dict (`{"type": "json_schema", ...}`).
        deadline: a `time.perf_counter()` time; a request not finished by then ends at the next
            step with what it generated (`finish_reason="length"`, as `max_time` ends one) and
            leaves the batch or the queue, its chunks freed.
        skip_special_tokens: leave special tokens out of the text (False keeps them, such as a
            tool-call marker; the end-of-sequence token is never text).
        adapter: the LoRA adapter it runs under, by name (`adapter_names()`); None: the model as
            it is (a PeftModel's active adapters, else the base).
        Raises ValueError/TypeError for a bad prompt, config, grammar or adapter; nothing is queued then.
        """
        self._check_open()
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise TypeError(f"deadline must be a time.perf_counter() time, got {type(deadline).__name__}")
        with self._lock:
            self._num_submitting += 1
        try:
            seqs = self.inputs.make_sequences(prompt, generation_config, True, logits_processor=logits_processor,
                                              stopping_criteria=stopping_criteria, grammar=grammar,
                                              skip_special_tokens=skip_special_tokens,
                                              adapter=self._resolve_adapter(adapter))
            return self._enqueue([seqs], deadline=deadline)[0]
        finally:
            with self._lock:
                self._num_submitting -= 1

    def abort(self, request_id: int) -> None:
        """Cancel a request (thread-safe). At the next step its sequences leave and
        their final deltas carry `finish_reason="abort"`; a finished request is left as is."""
        with self._lock:
            if not isinstance(request_id, int) or not 0 <= request_id < self._next_request_id:
                raise ValueError(f"unknown request id {request_id!r}")
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, running, being submitted, or has deltas `step()`
        has not returned yet."""
        with self._lock:
            return bool(self._inbox or self._live or self._undelivered or self._num_submitting)

    def step(self) -> list[RequestDelta]:
        """Run one engine iteration; returns the new tokens of every sample of an
        `add_request` request that advanced (here or in an iteration a `generate` or
        `stream` call ran). If the iteration raises, what advanced before is kept for
        the next call."""
        self._check_open()
        with self._stepping():
            self._iterate()
        with self._lock:
            deltas, self._undelivered = self._undelivered, []
        return deltas

    def stream(self, prompt, generation_config: GenerationConfig | None = None, *, logits_processor=None,
               stopping_criteria=None, grammar=None, adapter: str | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding its text as it is produced (`grammar`, `adapter` as
        in `add_request`).

        The request is validated now and queued when iteration starts; leaving the
        loop early aborts it. For `num_return_sequences > 1` use `add_request` and
        `step()`, whose deltas carry each sample's index.
        """
        self._check_open()
        seqs = self.inputs.make_sequences(prompt, generation_config, True, logits_processor=logits_processor,
                                          stopping_criteria=stopping_criteria, grammar=grammar,
                                          adapter=self._resolve_adapter(adapter))
        if len(seqs) > 1:
            raise ValueError(f"stream() yields one text; num_return_sequences={len(seqs)} needs add_request and "
                             "step(), whose deltas carry each sample's index")
        return self._stream(seqs)

    def _stream(self, seqs: list[Sequence]) -> Iterator[str]:
        channel: deque[RequestDelta] = deque()
        (request_id,) = self._enqueue([seqs], channel)
        finished = False
        try:
            while not finished:
                self._wait(channel)
                while channel:
                    delta = channel.popleft()
                    finished = finished or delta.finished
                    if delta.text:
                        yield delta.text
        finally:
            self._leave([request_id], aborted=not finished)

    # ----------------------------------------------------------- offline API
    def generate(self, prompts: list, generation_config: GenerationConfig | list | None = None, *,
                 progress: bool = False, logits_processor=None, stopping_criteria=None,
                 grammar=None, adapter: str | list | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results in input order, the samples of a
        prompt together (like `generate` with `num_return_sequences`).

        prompts: strings (tokenized as given), chat message lists (chat template with
        the generation prompt) or lists of token ids. All are validated before any runs.
        generation_config: one for every prompt, or a list of one per prompt (its own
        seed, length...). grammar: as in `add_request`, for every prompt. adapter: as in
        `add_request`, one for every prompt or a list of one per prompt (None: the model as it is).
        """
        self._check_open()
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        configs = generation_config
        if not isinstance(configs, (list, tuple)):
            configs = [generation_config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"generation_config: {len(configs)} configs for {len(prompts)} prompts")
        names = adapter if isinstance(adapter, (list, tuple)) else [adapter] * len(prompts)
        if len(names) != len(prompts):
            raise ValueError(f"adapter: {len(names)} adapters for {len(prompts)} prompts")
        resolved = {name: self._resolve_adapter(name) for name in dict.fromkeys(names)}
        batches = [
            self.inputs.make_sequences(p, config, False, logits_processor=logits_processor,
                                       stopping_criteria=stopping_criteria, grammar=grammar, adapter=resolved[name])
            for p, config, name in zip(prompts, configs, names)
        ]
        channel: deque[RequestDelta] = deque()
        request_ids = self._enqueue(batches, channel)
        pending: dict[tuple[int, int], RequestOutput | None] = {
            (s.request_id, s.index): None for seqs in batches for s in seqs
        }
        remaining = len(pending)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=remaining, desc="chunk-llama", unit="seq")
        try:
            while remaining:
                self._wait(channel)
                while channel:
                    delta = channel.popleft()
                    if delta.finished:
                        pending[(delta.request_id, delta.index)] = delta.output
                        remaining -= 1
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self._leave(request_ids, aborted=remaining > 0)
        return list(pending.values())

    # ------------------------------------------------------------- figures
    @property
    def stats(self) -> dict[str, Any]:
        """Counters and memory peaks (`figures.engine_stats` says what each is)."""
        return engine_stats(self)

    def describe(self) -> str:
        """One line for a start-up log: device, dtype, kernels and the KV pool."""
        return describe(self)

    def reset_peaks(self) -> None:
        """Start the peak figures of `stats` over from the current state."""
        with self._stepping():
            self.cache.tree.peak_live_chunks = self.cache.tree.num_live_chunks
            self.cache.pool.peak_used = self.cache.pool.num_used
            self.runner.peak_batch_size = len(self.scheduler.running)
            self.runner.peak_unshared_chunks = 0

    def close(self) -> None:
        """Release the cache; the engine refuses further work."""
        with self._stepping():
            self._closed = True
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
            self.scheduler.partial.clear()
            with self._lock:
                self._inbox.clear()
                self._live.clear()
                self._deadlines.clear()
            self.cache = None

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a chat message list or a list of token ids."""
        return self.inputs.tokenize(prompt)
