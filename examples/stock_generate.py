"""Stock `generate` on a patched model: rows with equal prefixes share chunks, and later
calls find the earlier calls' chunks (the model's own `ChunkCache`)."""

import torch
from transformers import GenerationConfig

import chunk_llama

model, tokenizer = chunk_llama.load_default_model()
chunk_llama.patch_model(model)  # or from_pretrained(..., attn_implementation="chunk_llama")
ids = tokenizer("The three primary colours are", return_tensors="pt")["input_ids"]
config = GenerationConfig(max_new_tokens=20, do_sample=True, top_p=0.9, num_return_sequences=4)
torch.manual_seed(0)
out = model.generate(ids, generation_config=config)
for row in out:
    print(repr(tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True)))
print(f"{model.chunk_llama_cache.pool.peak_used} chunks at peak for 4 sequences")
