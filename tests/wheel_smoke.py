"""Smoke test of an installed chunk-llama (run by tests/test_wheel.py, not collected by pytest).

Run with the interpreter of a virtual environment the wheel is installed in, from a
folder outside the repository, with `CHUNK_LLAMA_CACHE_DIR` set to an empty folder:

    python wheel_smoke.py VENV prebuilt|fallback

Checks that chunk_llama is imported from VENV (not the repository), runs greedy
generation of a tiny random Llama through the engine (two requests sharing a prefix
several chunks long) and compares the tokens with stock transformers `generate`, then
prints one JSON line: the attention backend, the fallback reason, the CPU library's
origin and path, and whether a C++ compiler is reachable. `prebuilt` expects the native
CPU kernel from the wheel's own `chunk_llama/_native/` and nothing built; `fallback`
expects the PyTorch reference with the reason (the caller removed the prebuilt library
and no compiler is reachable).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import chunk_llama
from chunk_llama.ops.build import spec as build
from chunk_llama.ops.cpu import attention as cpu


def main() -> None:
    venv, expect = Path(sys.argv[1]).resolve(), sys.argv[2]
    package = Path(chunk_llama.__file__).resolve().parent
    assert venv in package.parents, f"chunk_llama was imported from {package}, not from the wheel in {venv}"
    cache = Path(os.environ["CHUNK_LLAMA_CACHE_DIR"])
    try:
        compiler = build.find_compiler(build.cpu_build())
    except build.BuildError:
        compiler = None

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, head_dim=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, initializer_range=0.2, eos_token_id=5, bos_token_id=1,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()  # head dim 64, fp32: what the CPU kernel supports
    shared = [1] + [(7 * i) % 90 + 6 for i in range(40)]  # 41 tokens: two full chunks of 16 shared
    prompts = [shared + [11, 12, 13], shared + [20, 21]]
    options = GenerationConfig(max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        stock = [model.generate(torch.tensor([p]), generation_config=options)[0, len(p):].tolist()
                 for p in prompts]

    engine = chunk_llama.ChunkLlamaEngine(model, max_batch_size=2, chunk_size=16)
    ours = [out.token_ids for out in engine.generate(prompts, options)]
    assert ours == stock, f"engine tokens {ours} != stock generate {stock}"
    stats = engine.stats
    library = cpu.build()
    report = {"backend": stats["attention_backend"], "reason": stats["attention_fallback_reason"],
              "origin": library and library.origin, "library": library and str(library.path),
              "compiler": compiler, "built": sorted(p.name for p in cache.glob("*") if p.is_dir()), "tokens": ours}
    if expect == "prebuilt":
        assert library is not None, f"the CPU kernel did not load: {cpu.build_failed()}"
        assert library.origin == "prebuilt" and library.path.parent == package / "_native", report
        assert stats["attention_backend"].startswith("cpu:"), stats
        assert report["built"] == [], f"nothing should have been built, found {report['built']} in {cache}"
    else:
        assert library is None and stats["attention_backend"] == "reference", stats
    print(json.dumps(report))


if __name__ == "__main__":
    main()
