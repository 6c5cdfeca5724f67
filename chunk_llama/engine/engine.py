"""`ChunkLlamaEngine`: iteration-level batching over the prefix-aware cache.

Offline use is `generate(prompts)`. Online use is `add_request` (from any thread),
`step()` in a loop (one thread), `abort` and `stream`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig

from chunk_llama.engine.inputs import InputProcessor, positive_int
from chunk_llama.engine.request import RequestDelta, RequestOutput, Sequence
from chunk_llama.engine.runner import ModelRunner
from chunk_llama.engine.scheduler import Scheduler
from chunk_llama.engine.text import advance_text
from chunk_llama.hf import ChunkCache, is_patched, patch_model


class ChunkLlamaEngine:
    """Serve many prompts on one model, sharing the KV cache of common prefixes.

    Each step admits waiting requests in arrival order (batch and memory
    permitting), prefills them in one packed forward pass computing only the
    tokens after the longest prefix already cached, then decodes one token for
    every running sequence. Finished sequences leave at once; with
    `retain_prefixes` their full chunks stay cached until the pool needs room
    (least recently used first), so a later request with the same prefix skips
    its prefill.

    Args:
        model: a Llama-family transformers model (patched here if it is not yet).
        tokenizer: needed for text and chat prompts, text deltas and stop strings.
        max_batch_size: most sequences decoded at once.
        chunk_size: tokens per KV chunk (default: the patch's, 64).
        kv_cache_bytes: K/V budget for all layers (default: from free memory).
        max_prefill_tokens: most new prompt tokens computed in one step (a longer
            single prompt still runs, alone).
        retain_prefixes: keep the chunks of finished sequences as a prefix cache.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_batch_size: int = 32,
        chunk_size: int | None = None,
        kv_cache_bytes: int | None = None,
        max_prefill_tokens: int = 4096,
        retain_prefixes: bool = True,
    ):
        positive_int("max_batch_size", max_batch_size)
        positive_int("max_prefill_tokens", max_prefill_tokens)
        if chunk_size is not None:
            positive_int("chunk_size", chunk_size)
        if not is_patched(model):
            patch_model(model, chunk_size=chunk_size or 64)
        self.model = model
        self.tokenizer = tokenizer
        self.cache = ChunkCache(
            model,
            chunk_size=chunk_size or model.chunk_llama_chunk_size,
            kv_cache_bytes=kv_cache_bytes,
            retain_prefixes=retain_prefixes,
        )
        self.inputs = InputProcessor(model, tokenizer, self.cache.chunk_size, self.cache.pool.capacity)
        self.scheduler = Scheduler(self.cache, max_batch_size, max_prefill_tokens)
        self.runner = ModelRunner(model, self.cache, self.scheduler, self.inputs)
        self.max_batch_size = max_batch_size
        self.device = model.device
        self._lock = threading.Lock()  # guards the inbox, aborts and id counters
        self._inbox: list[Sequence] = []
        self._aborts: list[int] = []
        self._live: dict[int, list[Sequence]] = {}  # request id -> its sequences, until all finish
        self._undelivered: list[RequestDelta] = []  # deltas `stream`/`generate` saw for others
        self._next_request_id = 0
        self._next_seq_id = 0
        self._closed = False

    # ------------------------------------------------------------ online API
    def add_request(self, prompt, generation_config: GenerationConfig | None = None) -> int:
        """Queue a request (thread-safe); returns its id. It is admitted at the next `step()`.

        prompt: a string, a list of chat messages (chat template applied) or token ids.
        Raises ValueError/TypeError for a bad prompt or config; nothing is queued then.
        """
        return self._submit(prompt, generation_config, track_text=True)

    def abort(self, request_id: int) -> None:
        """Cancel a request (thread-safe). At the next `step()` its sequences leave and
        their final deltas carry `finish_reason="abort"`; a finished request is left as is."""
        with self._lock:
            if not isinstance(request_id, int) or not 0 <= request_id < self._next_request_id:
                raise ValueError(f"unknown request id {request_id!r}")
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._live or self._undelivered)

    def step(self) -> list[RequestDelta]:
        """Run one engine iteration; returns the new tokens of every sample that advanced."""
        self._check_open()
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            deltas, self._undelivered = self._undelivered, []
        for seq in inbox:
            self.scheduler.add(seq)
        for request_id in aborts:
            for seq in self.scheduler.abort(request_id):
                seq.finish_reason = "abort"
                deltas.append(self._delta(seq))
        if self.scheduler.has_work():
            deltas += [self._delta(seq) for seq in self.runner.run_iteration()]
        return deltas

    def stream(self, prompt, generation_config: GenerationConfig | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced.

        This drives `step()` itself, so it must not run while another thread does;
        deltas of other requests it meets are kept for the next `step()`.
        """
        request_id = self.add_request(prompt, generation_config)
        while True:
            finished = False
            for delta in self.step():
                if delta.request_id != request_id:
                    self._keep_for_step(delta)
                    continue
                if delta.text:
                    yield delta.text
                finished = delta.finished and request_id not in self._live
            if finished:
                return

    # ----------------------------------------------------------- offline API
    def generate(
        self, prompts: list, generation_config: GenerationConfig | None = None, *, progress: bool = False
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order, the samples of a
        prompt together (like `generate` with `num_return_sequences`).

        prompts: strings (tokenized as given), chat message lists (chat template with
        the generation prompt) or lists of token ids. All are validated before any runs.
        """
        self._check_open()
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        config = self.inputs.resolve_config(generation_config)
        pending: dict[tuple[int, int], RequestOutput | None] = {}
        batches = [self._build(prompt, config, track_text=False) for prompt in prompts]
        with self._lock:
            for seqs in batches:
                self._enqueue(seqs)
                pending.update({(s.request_id, s.index): None for s in seqs})
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pending), desc="chunk-llama", unit="seq")
        remaining = len(pending)
        while remaining:
            for delta in self.step():
                key = (delta.request_id, delta.index)
                if key not in pending:
                    self._keep_for_step(delta)
                elif delta.finished:
                    pending[key] = delta.output
                    remaining -= 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return list(pending.values())

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and memory peaks. `peak_kv_bytes` counts chunks held by live
        sequences; `peak_pool_bytes` also counts retained (cached) prefixes."""
        pool, tree = self.cache.pool, self.cache.tree
        return dict(
            self.runner.counters,
            peak_kv_bytes=tree.peak_live_chunks * pool.bytes_per_chunk,
            peak_pool_bytes=pool.peak_used * pool.bytes_per_chunk,
            peak_chunks_used=tree.peak_live_chunks,
            peak_unshared_kv_bytes=self.runner.peak_unshared_chunks * pool.bytes_per_chunk,
            peak_batch_size=self.runner.peak_batch_size,
            plan_rebuilds=self.cache.num_plan_rebuilds,
            plan_updates=self.cache.num_plan_updates,
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_chunks=tree.num_revived,
            evicted_chunks=tree.num_evicted,
            retained_chunks=tree.num_retained,
            chunks_in_use=pool.num_used,
            kv_capacity_chunks=pool.capacity,
            bytes_per_chunk=pool.bytes_per_chunk,
            chunk_size=pool.chunk_size,
        )

    def reset_peaks(self) -> None:
        """Start the peak figures of `stats` over from the current state."""
        self.cache.tree.peak_live_chunks = self.cache.tree.num_live_chunks
        self.cache.pool.peak_used = self.cache.pool.num_used
        self.runner.peak_batch_size = len(self.scheduler.running)
        self.runner.peak_unshared_chunks = 0

    def close(self) -> None:
        """Release the cache; the engine refuses further work."""
        self._closed = True
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self._live.clear()
        self.cache = None

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a chat message list or a list of token ids."""
        return self.inputs.tokenize(prompt)

    # ------------------------------------------------------------- requests
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ChunkLlamaEngine was closed; create a new one")

    def _submit(self, prompt, config: GenerationConfig | None, track_text: bool) -> int:
        self._check_open()
        seqs = self._build(prompt, self.inputs.resolve_config(config), track_text)
        with self._lock:
            self._enqueue(seqs)
        return seqs[0].request_id

    def _build(self, prompt, config: GenerationConfig, track_text: bool) -> list[Sequence]:
        with self._lock:  # reserve ids; building (tokenizing) runs outside the lock
            request_id = self._next_request_id
            first_seq_id = self._next_seq_id
            self._next_request_id += 1
            self._next_seq_id += config.num_return_sequences or 1
        return self.inputs.make_sequences(request_id, first_seq_id, prompt, config, track_text)

    def _keep_for_step(self, delta: RequestDelta) -> None:
        """A delta for another consumer: returned again by the next `step()`."""
        with self._lock:
            self._undelivered.append(delta)

    def _enqueue(self, seqs: list[Sequence]) -> None:
        """Caller holds the lock."""
        self._inbox.extend(seqs)
        self._live[seqs[0].request_id] = list(seqs)

    def _delta(self, seq: Sequence) -> RequestDelta:
        new_ids = seq.output_ids[seq.num_reported :]
        seq.num_reported = len(seq.output_ids)
        text = None
        if seq.track_text:
            with self.inputs.tokenizer_lock:
                advance_text(seq, self.tokenizer, flush=seq.is_finished)
            text, seq.num_reported_chars = seq.text[seq.num_reported_chars :], len(seq.text)
        output = None
        if seq.is_finished:
            output = self._output(seq)
            with self._lock:
                siblings = self._live.get(seq.request_id, [])
                if all(s.is_finished for s in siblings):
                    self._live.pop(seq.request_id, None)
        return RequestDelta(seq.request_id, seq.index, new_ids, text, seq.is_finished, seq.finish_reason, output)

    def _output(self, seq: Sequence) -> RequestOutput:
        seq.finish_time = seq.finish_time or time.perf_counter()
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(seq.output_ids),
            text=self.inputs.decode(seq.output_ids),
            finish_reason=seq.finish_reason,
            logits=torch.stack(seq.logits) if seq.keep_logits and seq.logits else None,
            index=seq.index,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
        )
