"""One engine iteration on the model: admit, prefill the admitted, decode everyone."""

from __future__ import annotations

import time

import torch

from chunk_llama.engine.inputs import InputProcessor
from chunk_llama.engine.request import Sequence
from chunk_llama.engine.sampler import select_tokens
from chunk_llama.engine.scheduler import Scheduler
from chunk_llama.engine.text import advance_text, hit_stop_string
from chunk_llama.hf import ChunkCache
from chunk_llama.kv import KVCacheFull


class ModelRunner:
    """Runs the forward passes of a step and turns logits into tokens."""

    def __init__(self, model, cache: ChunkCache, scheduler: Scheduler, inputs: InputProcessor):
        self.model = model
        self.cache = cache
        self.scheduler = scheduler
        self.inputs = inputs
        self.device = model.device
        self.peak_batch_size = 0
        self.peak_unshared_chunks = 0  # what the live sequences would hold with no sharing
        self.counters = dict(prefill_tokens_computed=0, prefill_tokens_reused=0, decode_steps=0, prefill_steps=0)

    def run_iteration(self) -> list[Sequence]:
        """Admit and prefill, then decode everyone; returns the sequences that got a token."""
        advanced: list[Sequence] = []
        admitted = self.scheduler.admit()
        self.peak_batch_size = max(self.peak_batch_size, len(self.scheduler.running))
        if admitted:
            advanced += self._prefill(admitted)
        if self.scheduler.running:  # the just prefilled decode their second token too
            advanced += self._decode(list(self.scheduler.running))
        return list({seq.seq_id: seq for seq in advanced}.values())

    @torch.no_grad()
    def _prefill(self, admitted: list[tuple[Sequence, int]]) -> list[Sequence]:
        seqs = [seq for seq, _ in admitted]
        starts = [matched for _, matched in admitted]
        input_ids, position_ids, last_index = self.cache.begin_prefill([s.seq_id for s in seqs], starts)
        self.counters["prefill_tokens_computed"] += input_ids.shape[1]
        self.counters["prefill_tokens_reused"] += sum(starts)
        self.counters["prefill_steps"] += 1
        logits = self._forward(seqs, input_ids, position_ids, logits_to_keep=last_index)
        return self._accept(seqs, logits[0])

    @torch.no_grad()
    def _decode(self, decoding: list[Sequence]) -> list[Sequence]:
        while True:
            try:
                order = self.cache.begin_decode({s.seq_id: s.output_ids[-1] for s in decoding})
                break
            except KVCacheFull:
                if len(self.scheduler.running) == 1:
                    raise
                victim = self.scheduler.preempt_newest()
                decoding = [s for s in decoding if s is not victim]
                if not decoding:
                    return []
        by_id = {s.seq_id: s for s in decoding}
        seqs = [by_id[i] for i in order]
        input_ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        position_ids = torch.tensor([[len(s.all_ids) - 1] for s in seqs], device=self.device)
        chunk_size = self.cache.chunk_size
        unshared = sum(-(-len(s.all_ids) // chunk_size) for s in seqs)
        self.peak_unshared_chunks = max(self.peak_unshared_chunks, unshared)
        self.counters["decode_steps"] += 1
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
        now = time.perf_counter()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.add_token(token, logits[i].float().cpu() if seq.keep_logits else None)
            seq.first_token_time = seq.first_token_time or now
            if seq.stop_strings and not seq.is_finished:
                with self.inputs.tokenizer_lock:
                    delta = advance_text(seq, self.inputs.tokenizer)
                if hit_stop_string(seq, delta):
                    seq.finish_reason = "stop"
            if seq.is_finished:
                seq.finish_time = now
                self.scheduler.finish(seq)
        return seqs
