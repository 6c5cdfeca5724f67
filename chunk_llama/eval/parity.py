"""Stock transformers `generate`, one request at a time: the greedy tokens to match, and
the eval's parity check of the engine against it on a sample."""

from __future__ import annotations

import torch

from chunk_llama.hf.generate import stock_generate


def trim_at_eos(tokens: list[int], eos_token_id) -> list[int]:
    """`tokens` up to and including the first EOS (an id, a list of ids or None)."""
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def stock_generate_tokens(model, prompt: list[int], config, eos_token_id) -> list[int]:
    """The new tokens of stock `generate` on one unpadded prompt, cut after the first EOS
    (on a model patched by chunk-llama: its class's generate, transformers' own cache and SDPA)."""
    with torch.no_grad():
        out = stock_generate(model, torch.tensor([prompt], device=model.device), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device))
    return trim_at_eos(out[0, len(prompt):].tolist(), eos_token_id)


def parity_sample(ids: list[int], count: int) -> list[int]:
    """`count` ids spread evenly over `ids`, not the first few (which may all be one app's)."""
    if count <= 0 or not ids:
        return []
    step = max(1, len(ids) // count)
    return ids[::step][:count]


def count_equal(model, prompts: list[list[int]], outputs: list[list[int]], config) -> dict:
    """How many engine `outputs` equal stock `generate` on their `prompts`, one by one."""
    eos = model.generation_config.eos_token_id
    equal = sum(stock_generate_tokens(model, prompt, config, eos) == output
                for prompt, output in zip(prompts, outputs, strict=True))
    return dict(checked=len(prompts), equal=equal)
