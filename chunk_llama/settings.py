"""The engine's options, declared once (`EngineArgs`) for Python and every command.

`chunk-llama generate`, `serve` and `eval` build their parsers from dataclasses with
`add_arguments`: one flag per field (`max_batch_size` -> `--max-batch-size`), its help
and default from the field, booleans as `--x/--no-x`, and each flag's default also
read from an environment variable (`CHUNK_LLAMA_MAX_BATCH_SIZE=8`), so a deployment
configures the server without a command line. A small builder rather than
transformers' `HfArgumentParser`: that one lists every flag twice (`--max_batch_size,
--max-batch-size`) and reads no environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field

from chunk_llama.errors import UsageError

ENV_PREFIX = "CHUNK_LLAMA_"
DEVICES_HELP = "auto (the first CUDA GPU if there is one, else the CPU), cpu, cuda or cuda:N"
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
MODEL_HELP = ("a .gguf file, a local folder, a hub id or 'gemma3-270m' (Gemma 3 270M from PyPI); "
              "default: SmolLM2-135M-Instruct")


def option(default, help: str, **argparse_kwargs):
    """A dataclass field that is also a command-line flag (`choices`, `metavar`, `nargs`, `action`...;
    `secret=True`: `--help` does not show its value)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **argparse_kwargs})
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class EngineArgs:
    """What `ChunkLlamaEngine` and the model loader take, for every front end."""

    model: str | None = option(None, MODEL_HELP)
    device: str = option("auto", DEVICES_HELP)
    dtype: str = option("auto", "the model's and the KV cache's dtype; auto: bfloat16 on a GPU (float16 where "
                                "bfloat16 is not supported); on the CPU a bfloat16 checkpoint's bfloat16 where the "
                                "CPU computes it natively (AVX512-BF16, AMX), else float32", choices=DTYPE_CHOICES)
    gguf_weights: str = option("auto", "a .gguf model's quantized tensors: quantized keeps their blocks (about "
                                       "the file's size in memory, and what a decode step reads; CPU, float32; "
                                       "a bfloat16 or float16 checkpoint's weights stay so the same way), "
                                       "dequantized is transformers' float32 copy, auto the first where it can",
                               choices=("auto", "quantized", "dequantized"))
    gguf_activations: str | None = option(
        None, "what a .gguf model's quantized blocks multiply their inputs with: float32 (the dequantized "
              "model's numbers, as stock computes them), int8 (quantized per group of 32 as llama.cpp does: "
              "integer dot products, faster prefill, a larger error), int16 (the same with 255 times finer "
              "steps: two int8 products per weight), auto: an integer mode where it was measured faster and "
              "within the error bound, else float32 (ops/cpu/activations.py; default: auto)",
        choices=("auto", "float32", "int8", "int16"))  # (activations.CHOICES, without importing torch here)
    max_batch_size: int = option(32, "most sequences decoded at once")
    chunk_size: int = option(64, "tokens per KV chunk")
    kv_cache_bytes: int | None = option(None, "K/V budget of all layers in bytes (default: from free memory)")
    kv_dtype: str = option("auto", "the K/V cache's dtype; auto: the model's, float16 where a GGUF model's blocks "
                                   "multiply integer activations on the CPU; bfloat16 or float16 under a float32 "
                                   "model on the CPU store K/V in half the bytes (attention still computed in "
                                   "float32)",
                           choices=DTYPE_CHOICES)
    max_prefill_tokens: int = option(1024, "most uncached prompt tokens computed in one step; longer prompts "
                                           "are prefilled in pieces between decode steps")
    prefix_caching: bool = option(True, "keep finished requests' chunks as a prefix cache "
                                        "(--no-prefix-caching frees them at once)")
    max_model_len: int | None = option(None, "most tokens of a request, prompt and new tokens together "
                                             "(default: the model's max_position_embeddings; a LongRoPE "
                                             "model's switch to its long factors)")
    revision: str | None = option(None, "the hub branch, tag or commit of --model")
    trust_remote_code: bool = option(False, "let transformers run the model repository's own code")
    chat_template: str | None = option(None, "a Jinja chat template, or a file holding one, replacing the "
                                             "tokenizer's")
    lora_modules: list[str] | None = option(None, "LoRA adapters to serve, each name=folder (a folder PEFT's "
                                                  "save_pretrained wrote); a request selects one by name "
                                                  "(the server's `model` field)", metavar="NAME=PATH")
    max_loras: int | None = option(None, "most LoRA adapters whose weights stay in memory at once (the least "
                                         "recently used one not in use gives its place; default: all)")
    max_lora_rank: int | None = option(None, "largest rank a LoRA adapter may have (default: any)")
    cuda_graphs: bool = option(False, "on a GPU, replay each decode step from CUDA graphs captured at start-up per "
                                      "batch size (experimental, off by default until measured on a GPU: "
                                      "--no-cuda-graphs, as enforce_eager, runs every step eager)")

    def engine_kwargs(self) -> dict:
        """The keyword arguments of `ChunkLlamaEngine` these settings give."""
        return dict(max_batch_size=self.max_batch_size, chunk_size=self.chunk_size,
                    kv_cache_bytes=self.kv_cache_bytes, kv_dtype=self.kv_dtype,
                    max_prefill_tokens=self.max_prefill_tokens,
                    retain_prefixes=self.prefix_caching, max_model_len=self.max_model_len,
                    lora_modules=lora_modules(self.lora_modules), max_loras=self.max_loras,
                    max_lora_rank=self.max_lora_rank, enforce_eager=not self.cuda_graphs)

    def load(self, announce: bool = True):
        """(model, tokenizer) on the chosen device and dtype (`loading.load_model`), the chat
        template replaced if one is given; `announce`: say what is loaded where on stderr (after
        the device and dtype were checked)."""
        from chunk_llama.hf.support import resolve_kv_dtype
        from chunk_llama.loading import checkpoint_dtype, load_model, resolve_device, resolve_dtype
        from chunk_llama.ops.cpu.activations import requested as requested_activations

        template = read_chat_template(self.chat_template) if self.chat_template is not None else None
        load_kwargs = dict(revision=self.revision, trust_remote_code=self.trust_remote_code)
        device = resolve_device(self.device)
        stored = None  # (auto on the CPU follows the checkpoint's dtype: read from its config alone)
        if self.dtype == "auto" and device.type == "cpu":
            stored = checkpoint_dtype(self.model, **load_kwargs)
        dtype = resolve_dtype(self.dtype, device, stored)
        try:  # before any weights are read
            resolve_kv_dtype(self.kv_dtype, dtype, device)
            requested_activations(self.gguf_activations)  # (CHUNK_LLAMA_GGUF_ACTIVATIONS unchecked by argparse)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if announce:
            name = self.model or "the default model (SmolLM2-135M-Instruct)"
            print(f"loading {name} on {device} in {str(dtype).removeprefix('torch.')} ...", file=sys.stderr)
        model, tokenizer = load_model(self.model, device=device, dtype=dtype, gguf_weights=self.gguf_weights,
                                      gguf_activations=self.gguf_activations, **load_kwargs)
        if template is not None and tokenizer is not None:
            tokenizer.chat_template = template
        return model, tokenizer

    def build_engine(self, model, tokenizer):
        from chunk_llama.engine import ChunkLlamaEngine

        try:  # (a bad setting or adapter: one line and exit code 2, as a bad flag)
            return ChunkLlamaEngine(model, tokenizer, **self.engine_kwargs())
        except ValueError as error:
            raise UsageError(str(error)) from None


def lora_modules(values: list[str] | None) -> dict[str, str] | None:
    """`--lora-modules name=path ...` as {name: path} (UsageError for a malformed or repeated one)."""
    if not values:
        return None
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UsageError(f"--lora-modules {value!r}: give each adapter as NAME=PATH")
        if name.strip() in out:
            raise UsageError(f"--lora-modules: the adapter name {name.strip()!r} is given twice")
        out[name.strip()] = path.strip()
    return out


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's content, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise UsageError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_type(tp):
    """The scalar type of a field (`int | None` -> int), and whether it is a list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _field_type(args[0])
    if origin is list:
        return typing.get_args(tp)[0], True
    return tp, False


def _from_env(name: str, kind, is_list: bool, default):
    raw = os.environ.get(ENV_PREFIX + name.upper())
    if raw is None:
        return default
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return [kind(x) for x in raw.split(",")] if is_list else kind(raw)
    except ValueError:
        raise SystemExit(f"error: {ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


def add_arguments(parser: argparse.ArgumentParser, *classes: type) -> None:
    """One flag per field of each dataclass in `classes`, grouped by class."""
    hints = {}
    for cls in classes:
        hints.update(typing.get_type_hints(cls))
        group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            kind, is_list = _field_type(hints[f.name])
            meta = dict(f.metadata)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = _from_env(f.name, kind, is_list, default)
            env = f"env {ENV_PREFIX}{f.name.upper()}"
            if kind is bool:
                group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                                   help=f"{meta.pop('help')} ({env})")
                continue
            help_text = f"{meta.pop('help')} ({env})"
            if meta.pop("secret", False):  # --help must not print a key read from the environment
                help_text += "%(default).0s"
            if is_list:
                meta.setdefault("nargs", "+")
            required = meta.pop("required", False) and default is None
            group.add_argument(_flag(f.name), type=kind, default=default, help=help_text, required=required,
                               **meta)


def to_argv(instance) -> list[str]:
    """The flags that give `instance` (a dataclass of `add_arguments`) again: one per field
    that differs from its default (for a command started from another)."""
    argv = []
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if value == default:
            continue
        if f.metadata.get("secret"):  # a command line is readable by every user of the machine (ps)
            raise ValueError(f"{f.name} is secret: give it to the other command in its environment "
                             f"({ENV_PREFIX}{f.name.upper()}), not on its command line")
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            continue
        elif isinstance(value, list):
            argv += [_flag(f.name), *map(str, value)]
        else:
            argv += [_flag(f.name), str(value)]
    return argv


def from_namespace(cls, namespace: argparse.Namespace):
    """The dataclass `cls` from parsed arguments (its fields only)."""
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; descriptions kept as written."""


def run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`args.func(args)`; a `UsageError` (a device this machine lacks) ends it with one line
    on stderr and exit code 2, as argparse ends a bad flag."""
    try:
        return args.func(args)
    except UsageError as error:
        parser.exit(2, f"{parser.prog} {args.command}: error: {error}\n")
