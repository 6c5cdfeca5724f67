"""Every private (underscored or internal-module) part of transformers chunk-llama uses, in
one list, and `check`, which says what a release changed.

transformers promises nothing about these, so pyproject.toml bounds the releases to the
ones tested (`transformers>=5.23,<5.25`) and `tests/test_private_api.py` runs `check`: on
a release that renames one, drops a parameter the code passes, or turns a property into a
method, the test fails naming it and the code that uses it, before anything subtler breaks.
Using one of these elsewhere means adding it here.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateApi:
    """`module:qualname` of the object; parameters: the names chunk-llama passes to it (for
    a callable); kind: "function", "property", "attribute" (exists) or "class"; used_in:
    where chunk-llama uses it."""

    path: str
    used_in: str
    parameters: tuple[str, ...] = ()
    kind: str = "function"


_GEN = "transformers.generation.utils:GenerationMixin"
_CACHE = "transformers.cache_utils:Cache"
_RESOLVE = "hf/generation.py (resolve: generate's settings for one prompt)"
_CACHE_USE = "hf/cache_api.py (ChunkCache overrides what the masks and generate ask a cache)"

PRIVATE_APIS = (
    PrivateApi(f"{_GEN}._prepare_generation_config", "hf/generation.py (resolve, unsupported_on_chunk_cache)",
               ("generation_config",)),
    PrivateApi(f"{_GEN}._prepare_generated_length", _RESOLVE,
               ("generation_config", "has_default_max_length", "has_default_min_length", "model_input_name",
                "input_ids_length", "inputs_tensor")),
    PrivateApi(f"{_GEN}._validate_generated_length", _RESOLVE,
               ("generation_config", "input_ids_length", "has_default_max_length")),
    PrivateApi(f"{_GEN}._prepare_special_tokens", _RESOLVE,
               ("generation_config", "kwargs_has_attention_mask", "device", "batch_size")),
    PrivateApi(f"{_GEN}._get_logits_processor", _RESOLVE,
               ("generation_config", "input_ids_seq_length", "encoder_input_ids", "logits_processor", "device",
                "model_kwargs")),
    PrivateApi("transformers.generation.configuration_utils:GenerationMode", "hf/generation.py (modes it runs)",
               kind="class"),
    PrivateApi(f"{_CACHE}.update", _CACHE_USE, ("key_states", "value_states", "layer_idx")),
    PrivateApi(f"{_CACHE}.get_seq_length", _CACHE_USE, ("layer_idx",)),
    PrivateApi(f"{_CACHE}.get_mask_sizes", _CACHE_USE, ("query_length", "layer_idx")),
    PrivateApi(f"{_CACHE}.get_query_offset", _CACHE_USE, ("layer_idx",)),
    PrivateApi(f"{_CACHE}.get_max_length", _CACHE_USE, ("layer_idx",)),
    *(PrivateApi(f"{_CACHE}.{name}", _CACHE_USE, kind="property")
      for name in ("is_compileable", "is_initialized", "is_sliding", "is_croppable")),
    PrivateApi("transformers.masking_utils:sdpa_mask", "hf/attention.py (the chunk_llama mask is sdpa's)",
               ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function", "attention_mask")),
    PrivateApi("transformers.masking_utils:AttentionMaskInterface", "hf/attention.py, hf/support.py (mask registered)",
               kind="class"),
    PrivateApi("transformers.integrations.sdpa_attention:sdpa_attention_forward",
               "hf/attention.py (stock attention outside a step)",
               ("module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal")),
    PrivateApi("transformers.modeling_utils:PreTrainedModel._supports_attention_backend",
               "hf/support.py (check_supported: the model takes a registered attention)", kind="attribute"),
    PrivateApi("transformers.modeling_utils:PreTrainedModel.post_init",
               "hf/integration.py (wrapped: from_pretrained(attn_implementation='chunk_llama') patches)", ()),
    PrivateApi("transformers.models.auto.modeling_auto:MODEL_FOR_CAUSAL_LM_MAPPING",
               "hf/support.py (the causal LM class of a config)", kind="attribute"),
    PrivateApi("transformers.modeling_gguf_pytorch_utils:TENSOR_PROCESSORS",
               "gguf/weights.py (the row order transformers gives a tensor)", kind="attribute"),
    PrivateApi("transformers.modeling_gguf_pytorch_utils:TensorProcessor.process",
               "gguf/weights.py (run on row numbers), gguf/load.py (each tensor, as transformers loads it)",
               ("weights", "name", "tensor_key_mapping", "parsed_parameters")),
    *(PrivateApi(f"transformers.modeling_gguf_pytorch_utils:{name}", "gguf/load.py (the plain processors)",
                 kind="class") for name in ("LlamaTensorProcessor", "Gemma2TensorProcessor")),
    PrivateApi("transformers.modeling_gguf_pytorch_utils:get_gguf_hf_weights_map",
               "gguf/weights.py, gguf/load.py (GGUF tensor name -> parameter name)", ("hf_model", "processor")),
    PrivateApi("transformers.modeling_gguf_pytorch_utils:load_gguf_checkpoint",
               "gguf/metadata.py (swapped within read_once: the config's metadata from our header reader)",
               ("gguf_checkpoint_path", "return_tensors")),
    *(PrivateApi(f"{module}:read_gguf_metadata", "gguf/metadata.py (swapped within read_once)",
                 ("gguf_path", "string_arrays"))
      for module in ("transformers.integrations.gguf.reader", "transformers.integrations.gguf")),
    PrivateApi("transformers.integrations.ggml:_gguf_parse_value",
               "gguf/metadata.py (_whole_lists_pass: a whole list under [ARRAY, ARRAY] passes as it is)",
               ("_value", "data_type")),
    PrivateApi("transformers.integrations.gguf:is_gguf_arch_supported",
               "gguf/load.py (files transformers converts its newer way are left to it)", ("gguf_arch",)),
    # the decoder layers fused_layers computes in one call (csrc/cpu/layer.cpp follows their forward)
    *(PrivateApi(f"transformers.models.{family}.modeling_{family}:{name}DecoderLayer.forward",
                 "hf/fused/layers.py (the layer's forward it replaces in decode steps)",
                 ("hidden_states", "position_embeddings"))
      for family, name in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
                           ("gemma3", "Gemma3"), ("phi3", "Phi3"))),
    PrivateApi("transformers.activations:GELUTanh", "hf/fused/describe.py (its `act`, F.gelu's tanh approximation)",
               kind="class"),
    PrivateApi("transformers.models.llama.modeling_llama:rotate_half", "csrc/cpu/layer.cpp (rotate)", ("x",)),
)


def _resolve(path: str):
    module_name, _, qualname = path.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = qualname.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def problem(api: PrivateApi) -> str | None:
    """What is wrong with `api` in the installed transformers, or None."""
    try:
        owner, name = _resolve(api.path)
    except (ImportError, AttributeError) as error:
        return f"{api.path} cannot be imported ({error})"
    raw = inspect.getattr_static(owner, name, None) if inspect.isclass(owner) else getattr(owner, name, None)
    if raw is None:
        return f"{api.path} does not exist"
    if api.kind == "property" and not isinstance(raw, property):
        return f"{api.path} is no longer a property (a {type(raw).__name__})"
    if api.kind == "class" and not inspect.isclass(raw):
        return f"{api.path} is no longer a class"
    if api.kind == "function":
        function = getattr(owner, name)
        if not callable(function):
            return f"{api.path} is no longer callable"
        parameters = inspect.signature(function).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        lost = [p for p in api.parameters if p not in parameters and not takes_any]
        if lost:
            return f"{api.path} no longer takes {', '.join(lost)}"
    return None


def check() -> list[str]:
    """One line per private API the installed transformers changed (empty: all as expected),
    each naming the chunk-llama code that uses it."""
    import transformers

    return [f"transformers {transformers.__version__}: {issue}; used in chunk_llama/{api.used_in}"
            for api in PRIVATE_APIS if (issue := problem(api)) is not None]
