"""Smoke test of an installed chunk-llama (run by tests/test_wheel.py, not collected by pytest).

Run with the interpreter of a virtual environment the wheel is installed in, from a
folder outside the repository, with `CHUNK_LLAMA_CACHE_DIR` set:

    python wheel_smoke.py VENV native|missing

Checks that chunk_llama is imported from VENV (not the repository), runs greedy
generation of a tiny random Llama through the engine (two requests sharing a
prefix several chunks long) and compares the tokens with stock transformers
`generate`, then prints one JSON line: the attention backend, the fallback reason,
where the kernel sources were looked up and, for `native`, the build folder.
`native` expects the C++ kernel built from the package's own `chunk_llama/csrc/`;
`missing` expects the reference with a reason naming the missing sources (the caller
removed them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import chunk_llama
from chunk_llama.ops import cpu, jit
from chunk_llama.ops.build import cpu_build


def main() -> None:
    venv, expect = Path(sys.argv[1]).resolve(), sys.argv[2]
    package = Path(chunk_llama.__file__).resolve().parent
    assert venv in package.parents, f"chunk_llama was imported from {package}, not from the wheel in {venv}"
    assert Path(jit.__file__).resolve().parent.parent == package
    cache = Path(os.environ["CHUNK_LLAMA_CACHE_DIR"])

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
    outputs = engine.generate(prompts, options)
    ours = [out.token_ids for out in outputs]
    assert ours == stock, f"engine tokens {ours} != stock generate {stock}"
    stats = engine.stats
    report = {"backend": stats["attention_backend"], "reason": stats["attention_fallback_reason"],
              "csrc": str(jit.CSRC), "package_csrc": str(jit.PACKAGE_CSRC), "tokens": ours}
    if expect == "native":
        assert jit.CSRC == jit.PACKAGE_CSRC == package / "csrc", (jit.CSRC, jit.PACKAGE_CSRC)
        assert cpu.build() is not None, f"the CPU kernel did not build: {cpu.build_failed()}"
        assert stats["attention_backend"].startswith("cpu:"), stats
        builds = sorted(cache.glob(f"{cpu_build().name}-torch*/build.ninja"))
        assert len(builds) == 1, f"expected one build of the CPU kernel in {cache}, found {builds}"
        ninja = builds[0].read_text()
        glue = package / "csrc" / "cpu" / "tpp_cpu_torch.cpp"
        assert str(glue) in ninja, f"not built from the package's sources ({glue} not in {builds[0]})"
        report["build"] = str(builds[0].parent)
    else:
        assert not jit.PACKAGE_CSRC.exists()
        assert stats["attention_backend"] == "reference", stats
        assert not list(cache.glob("*/build.ninja")), "nothing should have been built"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
