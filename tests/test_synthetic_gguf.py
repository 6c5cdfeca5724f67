"""scripts/synthetic_gguf.py: the random-weight Llama it writes (for timing model sizes no file
here has) loads with its K-quant blocks kept, and its hidden states stay finite."""

import os
import subprocess
import sys

import pytest
import torch

from chunk_llama.loading import load_model
from chunk_llama.ops.cpu.attention import build

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "synthetic_gguf.py")


@pytest.mark.skipif(build() is None, reason="the blocks stay quantized only with the CPU kernels")
def test_a_small_synthetic_model_loads_quantized_and_stays_finite(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    subprocess.run([sys.executable, SCRIPT, "--out", path, "--layers", "2", "--hidden", "256", "--ffn", "512",
                    "--heads", "4", "--kv-heads", "2", "--head-dim", "64"], check=True, capture_output=True)
    model, tokenizer = load_model(path)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "GGUFLinear" in kinds and "GGUFEmbedding" in kinds, kinds
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 256
    ids = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_sizes_that_are_not_whole_k_quant_blocks_are_refused(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "x.gguf"), "--hidden", "300"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "multiples of 256" in result.stderr
