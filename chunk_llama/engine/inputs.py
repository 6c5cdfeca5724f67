"""Turning a user's prompt and `GenerationConfig` into validated `Sequence`s.

Everything that can be wrong with a request is checked here, in the caller's
thread and before the engine sees it, so a bad request raises a clear error and
never disturbs the requests already running.
"""

from __future__ import annotations

import threading
import time

import torch
from transformers import GenerationConfig

from chunk_llama.engine.conversation import ConversationHistory
from chunk_llama.engine.grammar import GrammarCompiler, as_grammar
from chunk_llama.engine.request import SampleGroup, Sequence
from chunk_llama.engine.text import decode
from chunk_llama.hf import generation


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class InputProcessor:
    """Tokenizes prompts and builds the sequences of a request."""

    def __init__(self, model, tokenizer, chunk_size: int, capacity_chunks: int, max_batch_size: int,
                 max_model_len: int | None = None):
        self.model = model
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.capacity_chunks = capacity_chunks
        self.max_batch_size = max_batch_size
        # Fast tokenizers are not safe to call from several threads at once.
        self.tokenizer_lock = threading.Lock()
        # chat prompts continuing an earlier turn reuse its ids (conversation.py)
        self.conversations = None if tokenizer is None else ConversationHistory(tokenizer,
                                                                                self.tokenizer_lock)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, _eos_ids(model, tokenizer))

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a chat message list, a chat as a dict (`is_chat`:
        its messages, the tools its template renders, the template's options) or a list of
        token ids."""
        if isinstance(prompt, str) or is_chat(prompt):
            if self.tokenizer is None:
                raise ValueError("text and chat prompts need a tokenizer; pass one to ChunkLlamaEngine")
            if isinstance(prompt, str):
                with self.tokenizer_lock:
                    return list(self.tokenizer(prompt)["input_ids"])
            if isinstance(prompt, dict):
                options = {k: v for k, v in prompt.items() if k != "messages"}
                return self.conversations.prompt_ids(list(prompt["messages"]), **options)
            return self.conversations.prompt_ids(list(prompt))
        if isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.ndim == 1):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("a token-id prompt must contain only ints")
            return ids
        raise TypeError(
            f"a prompt must be a string, a list of chat messages or a list of token ids, got {type(prompt).__name__}"
        )

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        with self.tokenizer_lock:
            return decode(self.tokenizer, token_ids)

    def make_sequences(
        self, prompt, config: GenerationConfig | None, track_text: bool, *, logits_processor=None,
        stopping_criteria=None, grammar=None, skip_special_tokens: bool = True,
        adapter=None,
    ) -> list[Sequence]:
        """One sequence per returned sample; all share the prompt (and its chunks). The
        engine numbers them (`request_id`, `seq_id`) when it queues them. `grammar`: a
        `Grammar` or OpenAI `response_format` dict constraining every sample's output;
        `skip_special_tokens`: leave special tokens out of the text (`text.py`);
        `adapter`: what they run under (`AdapterRegistry.resolve`'s result)."""
        if not isinstance(skip_special_tokens, bool):
            raise TypeError(f"skip_special_tokens must be a bool, got {type(skip_special_tokens).__name__}")
        generation.check_config(config)
        grammar = as_grammar(grammar)
        if config is not None and config.max_new_tokens is not None:
            positive_int("max_new_tokens", config.max_new_tokens)
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        settings = generation.resolve(
            self.model, config, ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria
        )
        max_new, num_samples = settings.max_new_tokens, settings.num_samples
        limit = self.max_model_len  # (the engine's limit in force: the model's positions at most)
        if limit and len(ids) + max_new > limit:
            what = ("the model's max_position_embeddings"
                    if limit == getattr(self.model.config, "max_position_embeddings", None) else "max_model_len")
            raise ValueError(f"prompt of {len(ids)} tokens plus max_new_tokens={max_new} exceeds {what}={limit}")
        if num_samples > self.max_batch_size:
            raise ValueError(
                f"num_return_sequences={num_samples} exceeds max_batch_size={self.max_batch_size}: "
                "a request's samples run together"
            )
        # worst case: the prompt's full chunks once, then each sample's tail and new tokens
        c = self.chunk_size
        shared = (len(ids) - 1) // c
        chunks = shared + num_samples * -(-(len(ids) - shared * c + max_new) // c)
        if chunks > self.capacity_chunks:
            raise ValueError(
                f"a request of {len(ids)} prompt tokens, {max_new} new tokens and {num_samples} samples needs "
                f"{chunks} chunks but the KV cache holds {self.capacity_chunks}; raise kv_cache_bytes"
            )
        if settings.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer; pass one to ChunkLlamaEngine")
        generator = None
        if settings.do_sample and settings.seed is not None:  # as `torch.manual_seed(seed)` before generate
            generator = torch.Generator(device=self.model.device).manual_seed(settings.seed)
        group = SampleGroup(num_samples, generator)
        states = [self.grammars.start(grammar) if grammar is not None else None for _ in range(num_samples)]
        arrival = time.perf_counter()
        return [
            Sequence(
                seq_id=-1,
                request_id=-1,
                index=index,
                prompt=prompt,
                prompt_ids=ids,
                max_new_tokens=max_new,
                eos_token_ids=settings.eos_token_ids,
                processors=settings.processors[index],
                criteria=settings.criteria[index],
                do_sample=settings.do_sample,
                group=group,
                keep_logits=bool(settings.config.output_logits),
                keep_scores=bool(settings.config.output_scores),
                stop_strings=settings.stop_strings,
                track_text=(track_text and self.tokenizer is not None) or bool(settings.stop_strings),
                skip_special_tokens=skip_special_tokens,
                arrival_time=arrival,
                grammar=states[index],
                adapter=adapter,
            )
            for index in range(num_samples)
        ]


CHAT_OPTIONS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


def is_chat(prompt) -> bool:
    """Whether `prompt` is a chat: a list of message dicts, or a dict of `"messages"` (that
    list) and optionally the chat template's `CHAT_OPTIONS`: the `tools` it renders, its own
    variables (`chat_template_kwargs`, e.g. `enable_thinking`), `add_generation_prompt`
    (default true) and `continue_final_message` (the last, assistant message left open)."""
    if isinstance(prompt, dict):
        if set(prompt) - {"messages", *CHAT_OPTIONS} or not is_chat(prompt.get("messages")):
            raise TypeError('a chat prompt given as a dict has "messages" (a list of message dicts) and '
                            f"optionally {', '.join(CHAT_OPTIONS)}")
        return True
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _eos_ids(model, tokenizer) -> list[int]:
    """The model's end-of-sequence ids (its generation_config's, else the tokenizer's): what a
    grammar allows once its output is complete."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])
