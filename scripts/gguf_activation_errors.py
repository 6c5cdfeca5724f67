"""The error of `--gguf-activations int8` and `int16` (and of stock bfloat16 beside them) against the float64
truth of the same dequantized weights, teacher-forced over the shipped prompts.

    python scripts/gguf_activation_errors.py                      # the default model
    python scripts/gguf_activation_errors.py --model gemma3-270m
    python scripts/gguf_activation_errors.py --kv-dtypes bfloat16 float16   # also int16 over 16-bit K/V

The prompts are the shipped ones (`chunk-llama generate`'s defaults): the tool manual as the
system prompt, then each of the 16 questions (a chat where the model has a template, else
"manual, Q: question, A:"), as token ids; the manual's logits are computed once and each
question continues from its K/V (a copy of the cache per question), so every position of every
prompt is scored once. Systems, each on the model's logits at every position:
  truth          the float32-dequantized weights (what transformers loads the file as) in float64
  float32        chunk-llama's GGUF blocks on float32 activations (`--gguf-activations float32`)
  int8           the blocks on int8 activations (`--gguf-activations int8`)
  int16          the blocks on int16 activations (`--gguf-activations int16`)
  stock bf16     stock transformers on those weights cast to bfloat16
  int16, D K/V   (`--kv-dtypes D`) int16 with each new key and value rounded to D before it is
                 stored and read, as a K/V pool of dtype D (`kv_dtype`) holds them; "int16,
                 float16 K/V" is what `auto` runs on avx2 and avx512 (`kv_dtype=auto` holds
                 K/V in float16 under integer activations, `hf/support.py` `resolve_kv_dtype`)
Prints, per system: worst and mean |logit - truth| and the top-1 agreement with float32's and
with the truth's argmax. The issue's bound for a mode `auto` may pick: its top-1 agreement with
float32 >= 99.5% and its worst error no larger than stock bfloat16's.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from half_precision_errors import cast  # noqa: E402

from chunk_llama.cli import DEFAULT_PROMPTS, DEFAULT_SYSTEM, read_prompts  # noqa: E402
from chunk_llama.gguf.modules import set_gguf_activations  # noqa: E402
from chunk_llama.loading import load_model  # noqa: E402
from chunk_llama.ops.cpu import activations, isa  # noqa: E402


def prompt_parts(tokenizer) -> tuple[list[int], list[list[int]]]:
    """(the shared system part's ids, each question's ids after it)."""
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        manual = f.read()
    questions = read_prompts(DEFAULT_PROMPTS)
    if tokenizer.chat_template is None:
        system = tokenizer(manual)["input_ids"]
        tails = [tokenizer(f"\nQ: {q}\nA:", add_special_tokens=False)["input_ids"] for q in questions]
        return system, tails
    marker = "\x00QUESTION\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": manual}, {"role": "user", "content": marker}],
                                         tokenize=False, add_generation_prompt=True)
    head, tail = text.split(marker)
    system = tokenizer(head, add_special_tokens=False)["input_ids"]
    return system, [tokenizer(q + tail, add_special_tokens=False)["input_ids"] for q in questions]


PIECE = 256  # positions scored at once (a [PIECE, vocab] float64 per system: Gemma's vocabulary is 262,144)


class RoundedCache(DynamicCache):
    """A float32 model's K/V held in `dtype`, as the engine's pool holds them with `kv_dtype`:
    each new key and value rounded to it before it is stored and read."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.kv_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states.to(self.kv_dtype).float(), value_states.to(self.kv_dtype).float(),
                              layer_idx, *args, **kwargs)


class Scores:
    """Running figures of one system against the truth."""

    def __init__(self):
        self.worst, self.total, self.count, self.same_top, self.true_top = 0.0, 0.0, 0, 0, 0

    def add(self, logits: torch.Tensor, truth: torch.Tensor, float32_top: torch.Tensor) -> None:
        error = (logits.double() - truth).abs()
        top = logits.argmax(-1)
        self.worst = max(self.worst, error.max().item())
        self.total += error.sum().item() / error.shape[-1]
        self.count += error.shape[0]
        self.same_top += (top == float32_top).sum().item()
        self.true_top += (top == truth.argmax(-1)).sum().item()


@torch.no_grad()
def score(models: dict, system: list[int], tails: list[list[int]], kv_dtypes: dict | None = None
          ) -> dict[str, Scores]:
    """Each model's Scores over the system part (in pieces, each continuing the cache) and each
    tail after it (from a copy of the system's cache); `models` starts with the truth, then float32;
    kv_dtypes: the models whose K/V are held in another dtype, by name."""
    kv_dtypes = kv_dtypes or {}
    caches = {name: RoundedCache(kv_dtypes[name]) if name in kv_dtypes else DynamicCache() for name in models}
    scores = {name: Scores() for name in models if name != "truth"}

    def run(ids: list[int], cache_of) -> None:
        logits = {name: model(input_ids=torch.tensor([ids]), past_key_values=cache_of[name], use_cache=True).logits[0]
                  for name, model in models.items()}
        truth, float32_top = logits.pop("truth").double(), logits["float32"].argmax(-1)
        for name, value in logits.items():
            scores[name].add(value, truth, float32_top)

    for start in range(0, len(system), PIECE):
        run(system[start:start + PIECE], caches)
    for tail in tails:
        run(tail, {name: copy.deepcopy(cache) for name, cache in caches.items()})
    return scores


def measure(model: str | None, num_questions: int = 16, keep_float32: tuple[tuple[str, ...], ...] = (),
            kv_dtypes: tuple[torch.dtype, ...] = ()) -> tuple[dict[str, Scores], int]:
    """(each system's Scores, the positions scored) for `model` (None: the default model) over
    the system part and the first `num_questions` shipped questions; each of `keep_float32` adds
    an int8 system whose modules named so (last part of the name: lm_head, down_proj) keep float32,
    each of `kv_dtypes` an int16 system whose K/V are held in it."""
    torch.manual_seed(0)
    blocks, tokenizer = load_model(model, device="cpu", dtype=torch.float32, gguf_activations="float32")
    dequantized = load_model(model, device="cpu", dtype=torch.float32, gguf_weights="dequantized")[0]
    system, tails = prompt_parts(tokenizer)
    tails = tails[:num_questions]
    models = {"truth": cast(dequantized, torch.float64), "float32": blocks}
    for mode in activations.INTEGER_MODES:
        models[mode] = copy.deepcopy(blocks)
        set_gguf_activations(models[mode], mode)
    rounded = {f"int16, {str(dtype).removeprefix('torch.')} K/V": dtype for dtype in kv_dtypes}
    models.update(dict.fromkeys(rounded, models["int16"]))
    models["stock bf16"] = cast(dequantized, torch.bfloat16)
    for names in keep_float32:
        mixed = copy.deepcopy(models["int8"])
        for name, module in mixed.named_modules():
            if name.rpartition(".")[2] in names and hasattr(module, "set_activations"):
                set_gguf_activations(module, "float32")
        models[f"int8, {' and '.join(names)} float32"] = mixed
    return score(models, system, tails, rounded), len(system) + sum(map(len, tails))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or gemma3-270m (default: the default model)")
    parser.add_argument("--questions", type=int, default=16, help="how many of the shipped questions")
    parser.add_argument("--keep-float32", action="append", default=[], metavar="NAME[,NAME]",
                        help="also int8 with these modules (lm_head, down_proj, ...) in float32 (repeatable)")
    parser.add_argument("--kv-dtypes", nargs="+", default=[], choices=["bfloat16", "float16"],
                        help="also int16 with its K/V held in these dtypes")
    args = parser.parse_args()
    scores, positions = measure(args.model, args.questions, tuple(tuple(k.split(",")) for k in args.keep_float32),
                                tuple(getattr(torch, name) for name in args.kv_dtypes))
    print(f"# {args.model or 'default model'}: {positions} positions ({args.questions} questions); "
          f"{isa.describe_host()}, integer kernel {activations.int8_variant()}")
    print("| system | worst abs error | mean abs error | top-1 = float32's | top-1 = truth's |")
    print("|---|---|---|---|---|")
    for name, s in scores.items():
        print(f"| {name} | {s.worst:.4f} | {s.total / s.count:.5f} | {s.same_top / s.count * 100:.2f}% | "
              f"{s.true_top / s.count * 100:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
