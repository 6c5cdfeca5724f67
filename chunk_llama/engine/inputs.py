"""Turning a user's prompt and `GenerationConfig` into validated `Sequence`s.

Everything that can be wrong with a request is checked here, in the caller's
thread and before the engine sees it, so a bad request raises a clear error and
never disturbs the requests already running.
"""

from __future__ import annotations

import copy
import threading
import time

import torch
from transformers import GenerationConfig

from chunk_llama.engine.request import Sequence
from chunk_llama.engine.sampler import build_processors


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class InputProcessor:
    """Tokenizes prompts and builds the sequences of a request."""

    def __init__(self, model, tokenizer, chunk_size: int, capacity_chunks: int):
        self.model = model
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.capacity_chunks = capacity_chunks
        # Fast tokenizers are not safe to call from several threads at once.
        self.tokenizer_lock = threading.Lock()

    def resolve_config(self, config: GenerationConfig | None) -> GenerationConfig:
        if config is None:
            config = copy.deepcopy(self.model.generation_config)
        elif not isinstance(config, GenerationConfig):
            raise TypeError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")
        if config.max_new_tokens is None:
            raise ValueError("generation_config.max_new_tokens must be set")
        positive_int("max_new_tokens", config.max_new_tokens)
        positive_int("num_return_sequences", config.num_return_sequences or 1)
        if config.num_beams not in (None, 1):
            raise ValueError("beam search is not supported (num_beams must be 1)")
        stops = config.stop_strings
        if stops is not None:
            stops = [stops] if isinstance(stops, str) else stops
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise TypeError("stop_strings must be a non-empty string or a list of them")
            if self.tokenizer is None:
                raise ValueError("stop_strings need a tokenizer; pass one to ChunkLlamaEngine")
        return config

    def tokenize(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a chat message list or a list of token ids."""
        if isinstance(prompt, str) or (
            isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt)
        ):
            if self.tokenizer is None:
                raise ValueError("text and chat prompts need a tokenizer; pass one to ChunkLlamaEngine")
            with self.tokenizer_lock:
                if isinstance(prompt, str):
                    return list(self.tokenizer(prompt)["input_ids"])
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

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        with self.tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def make_sequences(
        self, request_id: int, first_seq_id: int, prompt, config: GenerationConfig, track_text: bool
    ) -> list[Sequence]:
        """One sequence per returned sample; all share the prompt (and its chunks)."""
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
        chunks = -(-(len(ids) + config.max_new_tokens) // self.chunk_size)
        if chunks > self.capacity_chunks:
            raise ValueError(
                f"a request of {len(ids)} prompt tokens and {config.max_new_tokens} new tokens needs {chunks} "
                f"chunks but the KV cache holds {self.capacity_chunks}; raise kv_cache_bytes"
            )
        stops = config.stop_strings
        stops = (stops,) if isinstance(stops, str) else tuple(stops or ())
        seed = getattr(config, "seed", None)
        arrival = time.perf_counter()
        seqs = []
        for index in range(config.num_return_sequences or 1):
            generator = None
            if config.do_sample and seed is not None:  # sample i draws from its own stream
                generator = torch.Generator(device=self.model.device).manual_seed(int(seed) + index)
            seqs.append(
                Sequence(
                    seq_id=first_seq_id + index,
                    request_id=request_id,
                    index=index,
                    prompt=prompt,
                    prompt_ids=ids,
                    max_new_tokens=config.max_new_tokens,
                    eos_token_ids=self._eos_ids(config),
                    processors=build_processors(config),
                    do_sample=bool(config.do_sample),
                    generator=generator,
                    keep_logits=bool(config.output_logits),
                    stop_strings=stops,
                    track_text=(track_text and self.tokenizer is not None) or bool(stops),
                    arrival_time=arrival,
                )
            )
        return seqs

    def _eos_ids(self, config: GenerationConfig) -> frozenset[int]:
        eos = config.eos_token_id  # unset falls back like `generate`: model config, then tokenizer
        if eos is None:
            eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else (eos or []))
