"""Writing a transformers model to a .gguf file as llama.cpp's converter would (gguf-py's
writer and name map, Llama's q/k row permutation, gguf-py's quantizers), for tests and
benchmarks that need GGUF files of architectures and sizes no installed file has. No
tokenizer is written: such a file loads with AutoConfig and a model loader, not
AutoTokenizer."""

from __future__ import annotations

import numpy as np
import torch

# the key writers for the config fields transformers reads back (integrations/ggml.py's GGUF_CONFIG_MAPPING)
_CONFIG_KEYS = {
    "add_context_length": "max_position_embeddings", "add_embedding_length": "hidden_size",
    "add_block_count": "num_hidden_layers", "add_feed_forward_length": "intermediate_size",
    "add_head_count": "num_attention_heads", "add_head_count_kv": "num_key_value_heads",
    "add_layer_norm_rms_eps": "rms_norm_eps", "add_vocab_size": "vocab_size",
}


def _llama_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of transformers' LlamaTensorProcessor's)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(path: str, model, arch: str, ggml_type: str = "Q8_0", name: str = "tiny", omit=()) -> None:
    """Write `model` (a transformers causal LM, float32) to `path` as GGUF architecture
    `arch` ("llama", "qwen2", "qwen3"; `name` "mistral" makes transformers read a llama
    file as Mistral): 2-D weights in `ggml_type` (a format gguf-py quantizes: Q4_0, Q4_1,
    Q5_0, Q8_0) where their width is whole blocks, the rest float32. A tied LM head is left
    out, as the converter leaves it, and so are the parameters and metadata writers
    (`_CONFIG_KEYS`) named in `omit`."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    for add, field in _CONFIG_KEYS.items():
        if add not in omit:
            getattr(writer, add)(getattr(config, field))
    rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    writer.add_rope_freq_base(float(rope_theta))
    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    quant = gguf.GGMLQuantizationType[ggml_type]
    block = gguf.GGML_QUANT_SIZES[quant][0]
    for hf_name, tensor in model.state_dict().items():
        if hf_name in omit or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"gguf-py names no tensor for {hf_name}"
        data = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")) and suffix == "weight":
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            data = _llama_permute(data, heads)
        if data.ndim == 2 and data.shape[1] % block == 0:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
