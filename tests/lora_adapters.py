"""LoRA adapters for the tests, made with PEFT from random weights on tiny random bases and
saved as PEFT saves them; and stock PEFT's answers under one adapter alone (the oracle)."""

from __future__ import annotations

import copy

import torch

# rank, targets, lora_alpha, rslora, rank/alpha patterns: ranks 4 to 32, different targets
SPECS = {
    "a": dict(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8),
    "b": dict(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
              lora_alpha=16, use_rslora=True),
    "c": dict(r=32, target_modules=["k_proj", "o_proj", "gate_proj"], lora_alpha=24),
    "d": dict(r=16, target_modules=["up_proj", "down_proj", "q_proj"], lora_alpha=16,
              rank_pattern={"down_proj": 12}, alpha_pattern={"q_proj": 40}),
}


def make_adapter(base: torch.nn.Module, folder: str, seed: int, scale: float = 1.0, **spec) -> str:
    """A random LoRA of `spec` (PEFT's LoraConfig) on a copy of `base`, its B factors drawn too
    (PEFT starts them at zero) and times `scale`; saved in `folder`, returned."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **spec))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return folder


def stock_peft(base: torch.nn.Module, folder: str | None):
    """`base` (a fresh copy) under the adapter saved in `folder` alone (None: the base)."""
    import peft

    model = copy.deepcopy(base)
    return model if folder is None else peft.PeftModel.from_pretrained(model, folder).eval()


def stock_answer(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Stock greedy `generate` on one prompt (an unpatched model, or PEFT's on one): (new
    tokens, their logits [new, vocab])."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def teacher_forced(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Stock logits for each of `generated` given what precedes it: [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1:]
