"""Loading a .gguf model tensor by tensor (`gguf/load.py`): the model equals what
`from_pretrained` followed by `keep_gguf_quantized` makes of the same file (every parameter
and buffer bit for bit, the same modules, the LM head tied to the embedding's blocks, the
same config and generation config), for Llama (tied and untied), Qwen2, Qwen3 and Phi-3
(Gemma 3's processor, which shifts its norms, in test_gguf_weights' Gemma 3 270M check); its peak memory is the file's size plus transients, not a float32
copy of the model; where the loader cannot build the model, `load_model` says why and goes
through `from_pretrained`. GGUF files are written by tests/gguf_files.py (gguf-py)."""

import logging
import os
import subprocess
import sys

import pytest
import torch
import transformers
from gguf_files import write_gguf
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from chunk_llama import loading
from chunk_llama.gguf import load as gguf_load
from chunk_llama.gguf.file import file_tensors
from chunk_llama.gguf.load import load_gguf_model
from chunk_llama.gguf.modules import GGUFEmbedding, GGUFLinear
from chunk_llama.gguf.weights import keep_gguf_quantized

SIZES = {"vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
# (config class, GGUF architecture, config overrides, GGML type)
FAMILIES = {
    "llama": (transformers.LlamaConfig, "llama", {"tie_word_embeddings": True}, "Q4_1"),  # no output.weight
    "llama_untied": (transformers.LlamaConfig, "llama", {"tie_word_embeddings": False}, "Q8_0"),
    "qwen2": (transformers.Qwen2Config, "qwen2", {}, "Q5_0"),  # q/k/v biases
    "qwen2_bf16": (transformers.Qwen2Config, "qwen2", {}, "BF16"),  # a bfloat16 file: kept in bfloat16
    "llama_f16": (transformers.LlamaConfig, "llama", {}, "F16"),  # a float16 file: kept in float16
    "qwen3": (transformers.Qwen3Config, "qwen3", {}, "Q4_0"),  # q/k norms, head_dim 128 (what a qwen3 file gives)
    # fused qkv_proj, gate_up_proj; a vocabulary holding the ids Phi-3's config defaults to (a GGUF gives none)
    "phi3": (transformers.Phi3Config, "phi3", {"vocab_size": 32064}, "Q8_0"),
}


def written(tmp_path, family: str):
    config_class, arch, overrides, ggml_type = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**{**SIZES, **overrides})).float()
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(path, model, arch, ggml_type)
    return path, ggml_type


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_by_tensor_equals_from_pretrained_then_blocks(tmp_path, family):
    path, ggml_type = written(tmp_path, family)
    folder, name = os.path.split(path)
    ours, kept = load_gguf_model(path, AutoConfig.from_pretrained(folder, gguf_file=name))
    assert ours is not None, kept
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    expected = sum(type(m) in (nn.Linear, nn.Embedding) for m in theirs.modules())  # every one kept in blocks
    assert keep_gguf_quantized(theirs, path) == {ggml_type: expected}
    assert kept == f"{expected} {ggml_type}" and not ours.training

    ours_tensors, their_tensors = tensors(ours), tensors(theirs)
    assert ours_tensors.keys() == their_tensors.keys()
    for key, value in ours_tensors.items():
        assert value.dtype == their_tensors[key].dtype and torch.equal(value, their_tensors[key]), key
        assert value.requires_grad == their_tensors[key].requires_grad, key
    assert [(n, type(m)) for n, m in ours.named_modules()] == [(n, type(m)) for n, m in theirs.named_modules()]
    assert isinstance(ours.lm_head, GGUFLinear) and isinstance(ours.model.embed_tokens, GGUFEmbedding)
    tied = ours.config.tie_word_embeddings
    assert tied == (family == "llama")
    assert (ours.lm_head.blocks is ours.model.embed_tokens.blocks) == tied
    ours_config, their_config = ours.config.to_dict(), theirs.config.to_dict()
    their_config.pop("quantization_config")  # from_pretrained's record of the GGUF file it read
    assert ours_config == their_config
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    ids = torch.tensor([[1, 5, 9, 33, 200, 17]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_load_model_falls_back_to_from_pretrained_with_the_reason(tmp_path, monkeypatch, caplog):
    path, _ = written(tmp_path, "llama")
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="llama.gguf")

    def load(**kwargs):
        return loading._gguf_model_tensor_by_tensor(path, config, torch.float32, torch.device("cpu"), False, kwargs)

    with caplog.at_level(logging.INFO, logger="chunk_llama.loading"):
        assert load(low_cpu_mem_usage=True) is None
        monkeypatch.setattr(gguf_load, "_plain_processors", lambda: ())
        assert load() is None
    assert "llama.gguf is loaded by from_pretrained (a float32 copy of every tensor on the way): " \
           "from_pretrained is given low_cpu_mem_usage" in caplog.text
    assert "transformers' LlamaTensorProcessor does more than reorder or shift a tensor" in caplog.text
    monkeypatch.undo()
    model = load(attn_implementation="eager")
    assert model is not None and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_in_bfloat16_every_tensor_is_cast_as_from_pretrained_casts_it(tmp_path, family):
    """No blocks in bfloat16 (they run in float32 only): each tensor is read, cast and
    loaded in turn, and the model is from_pretrained(dtype=bfloat16)'s, bit for bit."""
    path, _ = written(tmp_path, family)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=f"{family}.gguf")
    ours, kept = load_gguf_model(path, config, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"{family}.gguf", dtype=torch.bfloat16).eval()
    assert kept == "none" and not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in ours.modules())
    ours_tensors, their_tensors = tensors(ours), tensors(theirs)
    assert ours_tensors.keys() == their_tensors.keys()
    for key, value in ours_tensors.items():
        assert value.dtype == their_tensors[key].dtype and torch.equal(value, their_tensors[key]), key
    assert ours.config.tie_word_embeddings == (family == "llama")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == ours.config.tie_word_embeddings
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == ours.config.tie_word_embeddings


def test_a_file_without_its_kv_heads_goes_to_from_pretrained(tmp_path):
    """transformers' Llama processor reorders no q/k rows when the file does not give the
    head counts: the model from_pretrained makes of such a file is left to it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SIZES)).float()
    write_gguf(str(tmp_path / "old.gguf"), model, "llama", omit=("add_head_count_kv",))
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="old.gguf")
    loaded, why = load_gguf_model(str(tmp_path / "old.gguf"), config)
    assert loaded is None and why == "the file does not give llama.attention.head_count_kv"


def test_a_cut_short_file_is_a_value_error(tmp_path):
    path, _ = written(tmp_path, "llama")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="ends inside tensor"):
        file_tensors(path)
    with open(path, "r+b") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        file_tensors(path)


def test_a_parameter_the_file_lacks_sends_the_load_to_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SIZES)).float()
    path = str(tmp_path / "no_norm.gguf")
    write_gguf(path, model, "llama", omit=("model.norm.weight",))
    model, why = load_gguf_model(path, AutoConfig.from_pretrained(tmp_path, gguf_file="no_norm.gguf"))
    assert model is None and why == "the file has no tensor for model.norm.weight"


MEMORY_CHILD = """
import os, sys
from transformers import AutoConfig
from chunk_llama.gguf.load import load_gguf_model
path = sys.argv[1]
config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM (the peak resident set) starts again from here
def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
base = status("VmRSS")
model, why = load_gguf_model(path, config)
assert model is not None, why
print((status("VmHWM") - base) * 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_peak_memory_is_the_file_and_one_tensor_not_a_float32_model(tmp_path):
    """8 layers of hidden size 1024 in Q4_0: about 500 MB in float32, a 70 MB file, 17 MB
    the largest tensor in float32. from_pretrained holds the whole float32 state dict and
    the float32 model (over 1 GB) on the way."""
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    float32_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    path = str(tmp_path / "llama.gguf")
    write_gguf(path, model, "llama", "Q4_0")
    del model
    child = subprocess.run([sys.executable, "-c", MEMORY_CHILD, path], capture_output=True, text=True, check=True)
    peak = int(child.stdout.strip().splitlines()[-1])
    # the blocks, the file's pages as they are read, gguf-py's dequantized tensor, its processed copy, and
    # the interpreter's and reader's own
    bound = 2 * os.path.getsize(path) + 3 * largest + (128 << 20)  # measured 225 MiB of 316
    assert peak <= bound < float32_bytes, f"peak {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, " \
                                          f"float32 model {float32_bytes / 2**20:.0f} MiB"
