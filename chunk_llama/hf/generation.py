"""A request's generation settings, resolved exactly as transformers' `generate` resolves them.

Uses `generate`'s own steps on the model: the model's `generation_config` merged
under the user's (`_prepare_generation_config`, which also validates), the length
rules (`_prepare_generated_length`, `_validate_generated_length`: with neither
`max_new_tokens` nor `max_length` set, 20 new tokens), the special tokens, and the
logits processors and warpers (`_get_logits_processor`), built once per returned
sample since some are stateful. What cannot run per request in a batch raises a
`ValueError` naming the option. These are private transformers methods: they are
called here and nowhere else, so a change in transformers touches one file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxTimeCriteria

from chunk_llama.hf.support import rope_switch_length

# Options that change what generate returns but that no engine step can honour.
_UNSUPPORTED_MODES = {
    GenerationMode.BEAM_SEARCH: "beam search (num_beams > 1)",
    GenerationMode.BEAM_SAMPLE: "beam sampling (num_beams > 1)",
    GenerationMode.GROUP_BEAM_SEARCH: "group beam search (num_beam_groups > 1)",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "constrained beam search (constraints, force_words_ids)",
    GenerationMode.CONTRASTIVE_SEARCH: "contrastive search (penalty_alpha with top_k > 1)",
    GenerationMode.ASSISTED_GENERATION: "assisted generation (assistant_model, prompt_lookup_num_tokens, use_mtp)",
    GenerationMode.DOLA_GENERATION: "DoLa decoding (dola_layers)",
}
_UNSUPPORTED_FLAGS = {
    "output_attentions": "attention weights",
    "output_hidden_states": "hidden states",
    "token_healing": "token healing (it rewrites the prompt)",
}


@dataclass
class RequestSettings:
    """What the engine needs of one request's resolved `GenerationConfig`.

    processors: one `LogitsProcessorList` per returned sample (processors may keep state)
    criteria: extra stopping criteria per sample (max_time and the user's); EOS,
        max_new_tokens and stop strings are checked by the engine itself
    """

    config: GenerationConfig
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    num_samples: int
    do_sample: bool
    seed: int | None
    processors: list[LogitsProcessorList]
    criteria: list[StoppingCriteriaList]


def check_config(config: GenerationConfig | None) -> None:
    """Type checks that do not need the prompt (run before tokenizing)."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")


def unsupported_on_chunk_cache(model, config: GenerationConfig | None, generate_kwargs: dict,
                               input_length: int | None = None) -> str | None:
    """What in a stock `generate` call a `ChunkCache` cannot run (beam search, assisted
    decoding, attention outputs, ...), named, or None: `generate`'s own merge of the
    model's generation config under the call's settings decides the mode. input_length: the
    prompt's columns, where known (a LongRoPE model generating past its switch recomputes the
    cache there: `support.rope_switch_length`)."""
    settings = {k: v for k, v in generate_kwargs.items() if k not in ("generation_config", "assistant_model")}
    merged, _ = model._prepare_generation_config(copy.deepcopy(config) if config is not None else None, **settings)
    mode = merged.get_generation_mode(generate_kwargs.get("assistant_model"))
    if mode in _UNSUPPORTED_MODES:
        return _UNSUPPORTED_MODES[mode]
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode!r}"
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if getattr(merged, flag, None) and flag != "token_healing":
            return f"{flag}=True ({what})"
    if merged.use_cache is False:  # (every step feeds the whole sequence again: no cache to give it)
        return "use_cache=False"
    if merged.cache_implementation is not None:  # (after generate's merge, which drops the Hub's default "hybrid")
        return f"cache_implementation={merged.cache_implementation!r} (a cache generate makes itself)"
    switch = rope_switch_length(model.config)
    if switch is not None and input_length is not None:
        # (max_length counts the prompt; its default, 20, may be under it: generate still makes a token)
        total = max(merged.max_length, input_length + 1) if merged.max_new_tokens is None else \
            input_length + merged.max_new_tokens
        if total > switch:
            return f"LongRoPE past {switch} tokens (generate recomputes the cache with the long factors there)"
    return None


def resolve(
    model,
    config: GenerationConfig | None,
    prompt_ids: list[int],
    *,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
) -> RequestSettings:
    """The settings `generate` would use for this prompt alone (see module doc)."""
    check_config(config)
    prompt_len = len(prompt_ids)
    has_default_max_length = (config is None or config.max_length is None) and model.generation_config.max_length is None
    has_default_min_length = (config is None or config.min_length is None) and model.generation_config.min_length is None
    merged, _ = model._prepare_generation_config(copy.deepcopy(config) if config is not None else None)
    mode = merged.get_generation_mode()
    if mode in _UNSUPPORTED_MODES:
        raise ValueError(f"{_UNSUPPORTED_MODES[mode]} is not supported: chunk-llama decodes greedily or samples")
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"generation mode {mode!r} is not supported: chunk-llama decodes greedily or samples")
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if getattr(merged, flag, None):
            raise ValueError(f"{flag}=True is not supported: the engine does not return {what}")
    seed = getattr(merged, "seed", None)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    stops = merged.stop_strings
    stops = (stops,) if isinstance(stops, str) else stops
    if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops)):
        raise TypeError("stop_strings must be a non-empty string or a list of them")
    inputs = torch.tensor([prompt_ids], device=model.device)
    merged = model._prepare_generated_length(
        generation_config=merged,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=prompt_len,
        inputs_tensor=inputs,
    )
    model._validate_generated_length(merged, prompt_len, has_default_max_length)
    model._prepare_special_tokens(merged, kwargs_has_attention_mask=True, device=model.device, batch_size=1)
    eos = merged._eos_token_tensor
    num_samples = merged.num_return_sequences or 1
    processors = [
        model._get_logits_processor(
            generation_config=merged,
            input_ids_seq_length=prompt_len,
            encoder_input_ids=inputs,
            logits_processor=logits_processor,
            device=model.device,
            model_kwargs={},
        )
        for _ in range(num_samples)
    ]
    criteria = []
    for _ in range(num_samples):
        extra = StoppingCriteriaList(stopping_criteria or [])
        if merged.max_time is not None:
            extra.append(MaxTimeCriteria(max_time=merged.max_time))
        criteria.append(extra)
    return RequestSettings(
        config=merged,
        max_new_tokens=merged.max_length - prompt_len,
        eos_token_ids=frozenset(eos.tolist()) if eos is not None else frozenset(),
        stop_strings=tuple(stops or ()),
        num_samples=num_samples,
        do_sample=bool(merged.do_sample),
        seed=seed,
        processors=processors,
        criteria=criteria,
    )
