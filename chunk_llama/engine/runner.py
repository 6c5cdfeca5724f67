"""One engine iteration on the model: admit, then one forward that prefills the admitted
and decodes everyone already running.

An iteration that admits prompts (or the next piece of a long one) is a mixed step:
the running sequences' next tokens ride in the same packed forward as the prompt
pieces (each decoding sequence is one more packed sequence with one new token), so
the model's weights are read once for both, and a running request still gets a token
every iteration while a long prompt goes in pieces (chunked prefill). Without
admissions the step is a plain decode step through the two-phase kernel.

Each forward pass is one atomic step of the cache: it is committed only after the
forward completed and its tokens were selected, and rolled back if anything in
between raised (an exception, `KeyboardInterrupt`, a user's hook or processor).
A failed prefill puts the queue, the running list and a partly prefilled prompt
back as they were (its requests wait in arrival order, to be prefilled again), and
the running sequences it decoded as they were; a failed decode leaves the running
sequences as they were, to be decoded again. Nothing that advanced before the
failure is lost: `take_advanced` still returns it.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.stopping_criteria import MaxTimeCriteria

from chunk_llama.engine.inputs import InputProcessor
from chunk_llama.engine.request import Sequence
from chunk_llama.engine.sampler import select_tokens
from chunk_llama.engine.scheduler import PrefillWork, Scheduler
from chunk_llama.engine.text import advance_text, hit_stop_string
from chunk_llama.hf import ChunkCache
from chunk_llama.hf.compat import cache_argument
from chunk_llama.hf.patch import decode_logits
from chunk_llama.kv import KVCacheFull


class ModelRunner:
    """Runs the forward passes of a step and turns logits into tokens."""

    def __init__(self, model, cache: ChunkCache, scheduler: Scheduler, inputs: InputProcessor):
        self.model = model
        self.cache = cache
        self.scheduler = scheduler
        self.inputs = inputs
        self.device = model.device
        self.cache_argument = cache_argument(model)
        self.peak_batch_size = 0
        self.peak_unshared_chunks = 0  # what the live sequences would hold with no sharing
        self.counters = dict(prefill_tokens_computed=0, prefill_tokens_reused=0, decode_steps=0, prefill_steps=0)
        self._advanced: dict[int, Sequence] = {}
        self.graphs = None  # the decode steps' CUDA graphs (`graphs.DecodeGraphs`), or None: eager

    def run_iteration(self) -> None:
        """Admit, then prefill the admitted and decode the running in one forward (a plain
        decode step when nothing is admitted)."""
        try:
            admitted = self.scheduler.admit()
            for seq in self.scheduler.take_failed():  # (their adapter could not be read)
                seq.finish_time = time.perf_counter()
                self._advanced[seq.seq_id] = seq
            self.peak_batch_size = max(self.peak_batch_size, len(self.scheduler.running))
            if admitted:
                fresh = {id(w.seq) for w in admitted}
                self._prefill(admitted, [s for s in self.scheduler.running if id(s) not in fresh])
            elif self.scheduler.running:
                self._decode(list(self.scheduler.running))
        except BaseException:
            self.cache.end_step(completed=False)  # whatever raised, no step stays open (a no-op if ended)
            raise

    def take_advanced(self) -> list[Sequence]:
        """The sequences that got a token (or finished) since the last call."""
        advanced, self._advanced = list(self._advanced.values()), {}
        return advanced

    @torch.no_grad()
    def _prefill(self, work: list[PrefillWork], decoding: list[Sequence]) -> None:
        """One packed forward over this step's prompt pieces and the next token of each of
        `decoding`; the sequences whose prompt it completes get their first token. When the
        pool has no room for the decoding sequences' tokens beside the pieces, they decode
        in a forward of their own after it (which may preempt)."""
        seqs = [w.seq for w in work]
        complete = [i for i, s in enumerate(seqs) if self.cache.tree.seq_len(s.seq_id) == len(s.all_ids)]
        mark = self.cache.savepoint()
        try:
            self.cache.append_tokens({s.seq_id: s.output_ids[-1] for s in decoding})
            deferred = []
        except KVCacheFull:
            self.cache.rollback_to(mark)
            decoding, deferred = [], decoding
        selected = [seqs[i] for i in complete] + decoding
        try:
            input_ids, position_ids, last_index = self.cache.begin_prefill(
                [s.seq_id for s in seqs + decoding], [w.start for w in work] + [len(s.all_ids) - 1 for s in decoding]
            )
            keep = last_index[complete + list(range(len(seqs), len(seqs) + len(decoding)))]
            logits = self._forward(input_ids, position_ids, logits_to_keep=keep)[0]
            if selected:
                tokens, scores = self._select(selected, logits)
                stopped = self._stopped_by_criteria(selected, tokens, scores)
        except BaseException:
            self.cache.end_step(completed=False)
            self.scheduler.undo_admission()
            raise
        self.cache.end_step(completed=True)
        self.counters["prefill_tokens_computed"] += input_ids.shape[1] - len(decoding)
        self.counters["prefill_tokens_reused"] += sum(w.reused for w in work)
        self.counters["prefill_steps"] += 1
        self.counters["decode_steps"] += bool(decoding)
        for w in work:  # the first admission's hits (a re-prefill after preemption is not a request's hit)
            if w.seq.num_cached_tokens is None:
                w.seq.num_cached_tokens = w.reused
        if selected:
            self._note_unshared(self.scheduler.running)
            self._apply(selected, logits, tokens, scores, stopped)
        if deferred:
            self._decode([s for s in deferred if not s.is_finished])

    @torch.no_grad()
    def _decode(self, decoding: list[Sequence]) -> None:
        while True:
            try:
                order = self.cache.begin_decode({s.seq_id: s.output_ids[-1] for s in decoding},
                                                {s.seq_id: len(s.all_ids) - 1 for s in decoding})
                break
            except KVCacheFull:
                if not self.scheduler.can_preempt():
                    raise
                victims = set(map(id, self.scheduler.preempt_newest()))
                decoding = [s for s in decoding if id(s) not in victims]
                if not decoding:
                    return
        by_id = {s.seq_id: s for s in decoding}
        seqs = [by_id[i] for i in order]
        try:
            step = self.cache.step  # its inputs in plan order, at the step buffers' fixed addresses
            logits = self.graphs.run(step) if self.graphs is not None else None
            if logits is None:
                logits = self._decode_forward(step)[:, -1]
            tokens, scores = self._select(seqs, logits)
            stopped = self._stopped_by_criteria(seqs, tokens, scores)
        except BaseException:
            self.cache.end_step(completed=False)
            raise
        self.cache.end_step(completed=True)
        self._note_unshared(seqs)
        self.counters["decode_steps"] += 1
        self._apply(seqs, logits, tokens, scores, stopped)

    def _note_unshared(self, seqs: list[Sequence]) -> None:
        """What these sequences would hold with one copy each (no sharing), at most."""
        chunk_size = self.cache.chunk_size
        unshared = sum(-(-len(s.all_ids) // chunk_size) for s in seqs)
        self.peak_unshared_chunks = max(self.peak_unshared_chunks, unshared)

    def _decode_forward(self, step) -> torch.Tensor:
        """A decode step's logits [rows, 1, vocab]: the model's forward, without the module call
        where that computes the same (`patch.decode_logits`)."""
        kwargs = dict(input_ids=step.input_ids, position_ids=step.position_ids, use_cache=True, logits_to_keep=1,
                      **{self.cache_argument: self.cache})
        logits = decode_logits(self.model, self.cache, kwargs)
        return self.model(**kwargs).logits if logits is None else logits

    def _forward(self, input_ids, position_ids, logits_to_keep) -> torch.Tensor:
        return self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self.cache_argument: self.cache},
        ).logits

    @staticmethod
    def _select(seqs: list[Sequence], logits: torch.Tensor):
        """`select_tokens`, leaving the requests' generators as they were if it raises."""
        generators = {s.group.generator for s in seqs if s.do_sample and s.group.generator is not None}
        states = [(g, g.get_state()) for g in generators]
        try:
            return select_tokens(seqs, logits)
        except BaseException:
            for generator, state in states:
                generator.set_state(state)
            raise

    def _stopped_by_criteria(self, seqs: list[Sequence], tokens: list[int], scores) -> dict[int, str]:
        """Finish reasons from max_time and the user's stopping criteria, each sample on its
        own ids with the new token (what `generate` passes them). User code may raise, so
        this runs before the step commits."""
        stopped: dict[int, str] = {}
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if not seq.criteria:
                continue
            input_ids = torch.tensor([seq.all_ids + [token]], device=self.device)
            kept = tuple(s[None] for s in [*seq.scores, scores[i]]) if seq.keep_scores else None
            for criterion in seq.criteria:
                if bool(criterion(input_ids, kept).all()):
                    stopped[i] = "length" if isinstance(criterion, MaxTimeCriteria) else "stop"
                    break
        return stopped

    def _apply(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int], scores, stopped) -> None:
        """Give each sequence its token; finish those that stop. logits: [num_seqs, vocab]"""
        now = time.perf_counter()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.add_token(
                token,
                logits[i].float().cpu() if seq.keep_logits else None,
                scores[i].cpu() if scores[i] is not None else None,
            )
            seq.first_token_time = seq.first_token_time or now
            self._advanced[seq.seq_id] = seq
            if not seq.is_finished and i in stopped:
                seq.finish_reason = stopped[i]
            if seq.stop_strings and not seq.is_finished:
                with self.inputs.tokenizer_lock:
                    delta = advance_text(seq, self.inputs.tokenizer)
                if hit_stop_string(seq, delta):
                    seq.finish_reason = "stop"
            if seq.is_finished:
                seq.finish_time = now
                self.scheduler.finish(seq)
