"""`ChunkLlamaEngine`: iteration-level batching over the prefix-aware cache."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import GenerationConfig

from chunk_llama.engine.request import RequestOutput, Sequence
from chunk_llama.engine.sampler import build_processors, select_tokens
from chunk_llama.engine.scheduler import Scheduler
from chunk_llama.hf import ChunkCache, is_patched, patch_model
from chunk_llama.kv import KVCacheFull


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class ChunkLlamaEngine:
    """Serve many prompts on one model, sharing the KV cache of common prefixes.

    Each step admits waiting requests (batch and memory permitting), prefills them
    in one packed forward pass computing only the tokens after the longest prefix
    already cached, then decodes one token for every running sequence; finished
    sequences leave at once and free their private chunks.
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
    ):
        _positive_int("max_batch_size", max_batch_size)
        _positive_int("max_prefill_tokens", max_prefill_tokens)
        if chunk_size is not None:
            _positive_int("chunk_size", chunk_size)
        if not is_patched(model):
            patch_model(model, chunk_size=chunk_size or 64)
        self.model = model
        self.tokenizer = tokenizer
        self.cache = ChunkCache(
            model, chunk_size=chunk_size or model.chunk_llama_chunk_size, kv_cache_bytes=kv_cache_bytes
        )
        self.scheduler = Scheduler(self.cache, max_batch_size, max_prefill_tokens)
        self.max_batch_size = max_batch_size
        self.device = model.device
        self._next_seq_id = 0
        self._closed = False
        self._peak_batch_size = 0
        self._peak_unshared_chunks = 0
        self._counters = dict(prefill_tokens_computed=0, prefill_tokens_reused=0, decode_steps=0, prefill_steps=0)

    # ------------------------------------------------------------------ API
    def generate(
        self, prompts: list, generation_config: GenerationConfig | None = None, *, progress: bool = False
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order.

        prompts: strings (tokenized as given), chat message lists (chat template with
        the generation prompt) or lists of token ids.
        """
        self._check_open()
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        config = self._resolve_config(generation_config)
        seqs = [self._make_sequence(prompt, config) for prompt in prompts]  # validates all first
        for seq in seqs:
            self.scheduler.add(seq)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="chunk-llama", unit="req")
        pending = {seq.seq_id for seq in seqs}
        while pending:
            for seq in self._step():
                if seq.seq_id in pending:
                    pending.discard(seq.seq_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [self._output(seq) for seq in seqs]

    @property
    def stats(self) -> dict[str, Any]:
        pool = self.cache.pool
        return dict(
            self._counters,
            peak_kv_bytes=pool.peak_used * pool.bytes_per_chunk,
            peak_chunks_used=pool.peak_used,
            peak_unshared_kv_bytes=self._peak_unshared_chunks * pool.bytes_per_chunk,
            peak_batch_size=self._peak_batch_size,
            plan_rebuilds=self.cache.num_plan_rebuilds,
            plan_updates=self.cache.num_plan_updates,
            preemptions=self.scheduler.num_preemptions,
            chunks_in_use=pool.num_used,
            kv_capacity_chunks=pool.capacity,
            bytes_per_chunk=pool.bytes_per_chunk,
            chunk_size=pool.chunk_size,
        )

    def close(self) -> None:
        """Release the cache; the engine refuses further work."""
        self._closed = True
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.cache = None

    # ------------------------------------------------------------- requests
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ChunkLlamaEngine was closed; create a new one")

    def _resolve_config(self, config: GenerationConfig | None) -> GenerationConfig:
        if config is None:
            config = copy.deepcopy(self.model.generation_config)
        elif not isinstance(config, GenerationConfig):
            raise TypeError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")
        if config.max_new_tokens is None:
            raise ValueError("generation_config.max_new_tokens must be set")
        _positive_int("max_new_tokens", config.max_new_tokens)
        if config.num_beams not in (None, 1):
            raise ValueError("beam search is not supported (num_beams must be 1)")
        return config

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a chat message list or a list of token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass one to ChunkLlamaEngine")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise ValueError("chat prompts need a tokenizer; pass one to ChunkLlamaEngine")
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.ndim == 1):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("a token-id prompt must contain only ints")
            return ids
        raise TypeError(
            f"a prompt must be a string, a list of chat messages or a list of token ids, got {type(prompt).__name__}"
        )

    def _make_sequence(self, prompt, config: GenerationConfig) -> Sequence:
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions and len(ids) + config.max_new_tokens > max_positions:
            raise ValueError(
                f"prompt of {len(ids)} tokens plus max_new_tokens={config.max_new_tokens} exceeds "
                f"the model's max_position_embeddings={max_positions}"
            )
        chunks = -(-(len(ids) + config.max_new_tokens) // self.cache.chunk_size)
        if chunks > self.cache.pool.capacity:
            raise ValueError(
                f"a request of {len(ids)} prompt tokens and {config.max_new_tokens} new tokens needs {chunks} "
                f"chunks but the KV cache holds {self.cache.pool.capacity}; raise kv_cache_bytes"
            )
        seed = getattr(config, "seed", None)
        generator = None
        if config.do_sample and seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(seed))
        eos = config.eos_token_id  # unset falls back like `generate`: model config, then tokenizer
        if eos is None:
            eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        seq = Sequence(
            seq_id=self._next_seq_id,
            prompt=prompt,
            prompt_ids=ids,
            max_new_tokens=config.max_new_tokens,
            eos_token_ids=eos_ids,
            processors=build_processors(config),
            do_sample=bool(config.do_sample),
            generator=generator,
            keep_logits=bool(config.output_logits),
        )
        self._next_seq_id += 1
        return seq

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(seq.output_ids),
            text=text,
            finish_reason=seq.finish_reason,
            logits=torch.stack(seq.logits) if seq.keep_logits and seq.logits else None,
        )

    # ----------------------------------------------------------------- steps
    def _step(self) -> list[Sequence]:
        """One iteration: admit and prefill, then decode everyone; returns the finished."""
        finished: list[Sequence] = []
        admitted = self.scheduler.admit()
        self._peak_batch_size = max(self._peak_batch_size, len(self.scheduler.running))
        if admitted:
            finished += self._prefill(admitted)
        if self.scheduler.running:
            finished += self._decode()
        return finished

    @torch.no_grad()
    def _prefill(self, admitted: list[tuple[Sequence, int]]) -> list[Sequence]:
        seqs = [seq for seq, _ in admitted]
        starts = [matched for _, matched in admitted]
        input_ids, position_ids, last_index = self.cache.begin_prefill([s.seq_id for s in seqs], starts)
        self._counters["prefill_tokens_computed"] += input_ids.shape[1]
        self._counters["prefill_tokens_reused"] += sum(starts)
        self._counters["prefill_steps"] += 1
        logits = self._forward(seqs, input_ids, position_ids, logits_to_keep=last_index)
        return self._accept(seqs, logits[0])

    @torch.no_grad()
    def _decode(self) -> list[Sequence]:
        while True:
            running = self.scheduler.running
            try:
                order = self.cache.begin_decode({s.seq_id: s.output_ids[-1] for s in running})
                break
            except KVCacheFull:
                if len(running) == 1:
                    raise
                self.scheduler.preempt_newest()
        by_id = {s.seq_id: s for s in running}
        seqs = [by_id[i] for i in order]
        input_ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        position_ids = torch.tensor([[len(s.all_ids) - 1] for s in seqs], device=self.device)
        chunk_size = self.cache.chunk_size
        unshared = sum(-(-len(s.all_ids) // chunk_size) for s in seqs)
        self._peak_unshared_chunks = max(self._peak_unshared_chunks, unshared)
        self._counters["decode_steps"] += 1
        logits = self._forward(seqs, input_ids, position_ids, logits_to_keep=1)
        return self._accept(seqs, logits[:, -1])

    def _forward(self, seqs: list[Sequence], input_ids, position_ids, logits_to_keep) -> torch.Tensor:
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        except BaseException:
            # The step's tokens have no K/V: drop these sequences from the tree and requeue them.
            for seq in seqs:
                if seq in self.scheduler.running:
                    self.scheduler.running.remove(seq)
                    self.cache.remove_sequence(seq.seq_id)
                    self.scheduler.waiting.appendleft(seq)
            raise
        return out.logits

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """logits: [num_seqs, vocab] for the next token of each sequence."""
        tokens = select_tokens(seqs, logits)
        finished = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.add_token(token, logits[i].float().cpu() if seq.keep_logits else None)
            if seq.is_finished:
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished
