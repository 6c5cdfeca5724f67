"""Loading a .gguf model: peak memory and time of chunk-llama's tensor-by-tensor load
(`gguf/load.py`; `load_model`: that and the config and tokenizer, what a user waits for), of
transformers' `from_pretrained` followed by keeping the blocks (the
path before it, still the fallback), of stock `from_pretrained` (float32) and of llama.cpp's
`llama-server` (start to ready on /health, one slot of 512 tokens), each in its own process,
on the same file.

    python scripts/bench_gguf_load.py                  # the default model
    python scripts/bench_gguf_load.py --model gemma3-270m
    python scripts/bench_gguf_load.py --synthetic 2048 16 --type Q4_0   # a random Llama: hidden size, layers
    python scripts/bench_gguf_load.py --model big.gguf --ways tensor_by_tensor llama.cpp

`--synthetic H L` writes a random Llama of hidden size H and L layers (MLP 4H, 4x fewer KV
heads, a 32,000-token vocabulary, untied) to a temporary GGUF file first (gguf-py's
quantizer; tests/gguf_files.py). Peak is the process's maximum resident set (VmHWM, reset
after importing everything) minus what it had then, so the reader's metadata, the file's
mapped pages and every transient count (not the tokenizer: none of the three loads it).
llama.cpp's peak is its server's VmHWM once ready (its imports are its binary's), with the
file's pages mapped (`--no-mmap` is not passed: its default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("load_model", "tensor_by_tensor", "from_pretrained_then_blocks", "stock_float32", "llama.cpp")


def _measure(path: str, way: str) -> dict:
    """One load of `path` in this process (run in a child): peak MB above the imports, seconds, weight MB."""
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from chunk_llama.gguf import load as gguf_load
    from chunk_llama.gguf import weights as gguf_weights
    from chunk_llama.hf.support import check_supported
    from chunk_llama.loading import load_model

    folder, name = os.path.split(path)
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here (Linux >= 4.0)
        f.write("5")
    base = _status_kb("VmHWM")
    start = time.perf_counter()
    if way == "load_model":
        model, _ = load_model(path, device="cpu")
        return _result(model, base, time.perf_counter() - start)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    check_supported(config)
    if way == "tensor_by_tensor":
        model, why = gguf_load.load_gguf_model(path, config)
        assert model is not None, why
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        if way == "from_pretrained_then_blocks":
            gguf_weights.keep_gguf_quantized(model, path)
    return _result(model, base, time.perf_counter() - start)


def _result(model, base_kb: int, seconds: float) -> dict:
    peak = _status_kb("VmHWM") - base_kb
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return {"peak_mb": peak / 1024, "seconds": seconds, "weights_mb": sum(storages.values()) / 1e6}


def _measure_llama_cpp(path: str) -> dict:
    """llama-server on `path` (the cached build, scripts/build_llama_cpp.sh): seconds from start to
    ready and its peak resident MB then."""
    import time

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from llama_cpp_peer import LlamaServer, find_bin

    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        start = time.perf_counter()
        with LlamaServer(find_bin(), path, slots=1, ctx_per_slot=512, threads=os.cpu_count() or 1,
                         log_path=log.name) as server:
            seconds = time.perf_counter() - start
            peak = _status_kb("VmHWM", server.proc.pid)
    return {"peak_mb": peak / 1024, "seconds": seconds, "weights_mb": None}


def _status_kb(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _synthetic(hidden: int, layers: int, ggml_type: str, folder: str) -> str:
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from gguf_files import write_gguf

    heads = max(1, hidden // 64)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 4), tie_word_embeddings=False,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.LlamaForCausalLM(config).float()
    path = os.path.join(folder, f"llama-{hidden}x{layers}-{ggml_type}.gguf")
    write_gguf(path, model, "llama", ggml_type)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf path, 'gemma3-270m', or the default model")
    parser.add_argument("--synthetic", type=int, nargs=2, metavar=("HIDDEN", "LAYERS"))
    parser.add_argument("--type", default="Q4_0", help="--synthetic's GGML type (Q4_0, Q4_1, Q5_0, Q8_0)")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # child: path, way
    args = parser.parse_args()
    if args.measure:
        path, way = args.measure
        print(json.dumps(_measure_llama_cpp(path) if way == "llama.cpp" else _measure(path, way)))
        return
    from chunk_llama.loading import model_path

    with tempfile.TemporaryDirectory() as folder:
        if args.synthetic:
            path = _synthetic(*args.synthetic, args.type, folder)
        else:
            path = model_path(args.model)
        file_mb = os.path.getsize(path) / 1e6
        print(f"{os.path.basename(path)}: {file_mb:.0f} MB")
        print("| load | peak RSS above imports (MB) | x file | seconds | weights (MB) |\n|---|---|---|---|---|")
        for way in args.ways:
            child = subprocess.run([sys.executable, __file__, "--measure", path, way], capture_output=True, check=False,
                                   text=True, cwd=ROOT)
            if child.returncode != 0:
                last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode} (killed?)"])[-1]
                print(f"| {way} | failed: {last} | | | |")
                continue
            result = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"| {way} | {result['peak_mb']:.0f} | {result['peak_mb'] / file_mb:.1f} | "
                  f"{result['seconds']:.1f} | {'-' if result['weights_mb'] is None else round(result['weights_mb'])} |",
                  flush=True)


if __name__ == "__main__":
    main()
