"""chunk-llama as transformers' own: `attn_implementation="chunk_llama"`.

`import chunk_llama` registers the attention (and its mask function) under the name
`chunk_llama`, and wraps `PreTrainedModel.post_init` (what every model's `__init__`
calls last) once: a causal LM built with that attention implementation, by
`from_pretrained(..., attn_implementation="chunk_llama")` or `from_config`, is patched
as it is built (`patch_model`: its `generate` then keeps a prefix cache of its own).
Built before its weights are loaded, so accelerate's hooks (`device_map`, offload) go
around the patched layers and bring the weights in before them. Every other model is
left as it is: the wrapper only compares one attribute.
"""

from __future__ import annotations

import functools

from transformers import GenerationMixin, PreTrainedModel

from chunk_llama.hf import attention

_installed = False


def install() -> None:
    """Register the attention and the post-init patch (idempotent)."""
    global _installed
    attention.register()
    if _installed:
        return
    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if (getattr(self.config, "_attn_implementation", None) == attention.ATTN_IMPLEMENTATION
                and isinstance(self, GenerationMixin) and self.can_generate()):
            from chunk_llama.hf.patch import patch_model

            patch_model(self)
        return result

    PreTrainedModel.post_init = post_init
    _installed = True
