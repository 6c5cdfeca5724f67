"""One request alone on the CPU: prefill and decode speed of stock transformers, chunk-llama and
llama.cpp on the same GGUF file, the same prompt tokens and the same greedy settings.

    python scripts/bench_single.py                           # 300-token prompt, 64 new tokens, 5 repeats
    python scripts/bench_single.py --gguf-weights quantized dequantized   # both chunk-llama weight forms
    python scripts/bench_single.py --gguf-activations float32 auto   # both activation modes of the blocks
    python scripts/bench_single.py --prompt-tokens 32 --new-tokens 4 --repeat 1   # a smoke run
    python scripts/bench_single.py --interleave --repeat 9   # chunk-llama and llama.cpp run by run

The prompt is a chat (the shipped tool manual as the system prompt, cut so that the templated
prompt is `--prompt-tokens` tokens by the model's tokenizer, then the first shipped question);
every system gets exactly these token ids and generates exactly `--new-tokens` tokens greedily
(EOS masked: `min_new_tokens` in transformers, `ignore_eos` in llama.cpp, both a -inf bias).

Systems (one process, one after the other, each warmed up once, then `--repeat` runs; with
`--interleave`, stock first, then one run of every other system per round, all loaded at once):
  stock        transformers `generate` on the GGUF dequantized to float32 by transformers (SDPA);
               `--stock-bfloat16` adds "stock (bfloat16)", that copy in bfloat16
  chunk-llama  `ChunkLlamaEngine` (one request, prefix retention off so each run computes the
               prompt) on the model `chunk_llama.loading.load_model` gives; `--gguf-weights X`
               forwards `gguf_weights=X` to it (one system per value, named after it), so does
               `--gguf-activations Y` (`gguf_activations=Y`; without it, load_model's default: the
               CHUNK_LLAMA_GGUF_ACTIVATIONS environment variable, else auto), and
               `--chunk-llama-arg KEY=VALUE` any other keyword (VALUE read as JSON, else a string)
  llama.cpp    `llama-server -np 1` built by scripts/build_llama_cpp.sh; the figures are the ones
               its response reports (`timings.prompt_ms`, `timings.predicted_per_second`), so its
               HTTP is not counted, as none is for the in-process systems. Skipped with the reason
               when not built (`--build-llama-cpp` builds it first).
Figures, medians of the runs, defined as llama-server defines them: prefill = time from the start
to the first new token (the prompt's forward and the first sampling); decode = tokens after the
first over the time from the first token to the last. `--llama-bench` adds llama-bench's own
pp/tg figures (random tokens, no server) as a cross-check.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

import chunk_llama
from chunk_llama.cli import DEFAULT_PROMPTS, DEFAULT_SYSTEM, read_prompts
from chunk_llama.loading import load_model, model_path
from chunk_llama.ops.cpu import activations

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_peer as peer  # noqa: E402


# ------------------------------------------------------------------ the prompt
def chat_prompt_ids(tokenizer, target: int) -> list[int]:
    """A chat of `target` tokens (at most): the tool manual cut to fit, then the first question
    (for a model without a chat template, the two as plain text)."""
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        manual = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
    while len(manual) < target:
        manual = manual + manual
    question = read_prompts(DEFAULT_PROMPTS)[0]

    def ids(k: int) -> list[int]:
        if tokenizer.chat_template is None:  # a base model (Gemma 3 270M): the manual, then "Q: ...\nA:"
            return tokenizer(f"{tokenizer.decode(manual[:k])}\nQ: {question}\nA:")["input_ids"]
        chat = [{"role": "system", "content": tokenizer.decode(manual[:k])},
                {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    low, high = 0, target  # the largest cut whose chat fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(ids(mid)) <= target else (low, mid - 1)
    return ids(low)


# ------------------------------------------------------------------ systems
class _Clock(BaseStreamer):
    """Times `generate`'s new tokens: its first put() is the prompt, each later one a token."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self):
        pass


def _figures(start: float, token_times: list[float]) -> tuple[float, float]:
    """(prefill ms, decode tokens/s) from the start time and each new token's time."""
    prefill_ms = (token_times[0] - start) * 1e3
    if len(token_times) < 2:
        return prefill_ms, float("nan")
    decode = (len(token_times) - 1) / (token_times[-1] - token_times[0])
    return prefill_ms, decode


@torch.no_grad()
def run_stock(model, prompt: list[int], new_tokens: int, runs: int):
    input_ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=model.generation_config.eos_token_id)
    results = []
    for _ in range(runs):
        clock = _Clock()
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config, streamer=clock)
        results.append((*_figures(start, clock.times), out[0, len(prompt):].tolist()))
    return results


def torchao_quantized(model, kind: str):
    """model (the dequantized copy, in the activations' dtype) with torchao's weight-only
    quantization on every linear layer, in place: int8 per channel, or int4 in groups of 32
    in torchao's CPU layout (tinygemm's _weight_int4pack_mm_for_cpu)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if kind == "int4":
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=32)
    else:
        config = Int8WeightOnlyConfig()
    quantize_(model, config)
    return model


def chunk_llama_runs(model, tokenizer, prompt: list[int], new_tokens: int):
    """One run per next(): (prefill ms, decode tokens/s, tokens) of the prompt on one engine
    (closed with the generator)."""
    engine = chunk_llama.ChunkLlamaEngine(model, tokenizer, max_batch_size=1, kv_cache_bytes=1 << 28,
                                          retain_prefixes=False)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    try:
        while True:
            engine.add_request(list(prompt), config)
            times, tokens, output = [], [], None
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    now = time.perf_counter()
                    times += [now] * len(delta.token_ids)
                    tokens += delta.token_ids
                    output = delta.output or output
            assert output is not None and output.num_cached_tokens == 0, "the prompt came from the cache"
            yield (*_figures(start, times), tokens)
    finally:
        engine.close()


def llama_cpp_runs(bin_dir: str, gguf: str, prompt: list[int], new_tokens: int, threads: int, logs: str):
    """One run per next(), each on its own `llama-server -np 1`, stopped before the run is
    returned: an idle server's threads poll for work, which on a 2-core host took a fifth
    of chunk-llama's decode speed while both were up (`--interleave`)."""
    import httpx

    body = peer.greedy_body(prompt, new_tokens, cache_prompt=False)  # every run computes the prompt
    while True:
        with peer.LlamaServer(bin_dir, gguf, slots=1, ctx_per_slot=len(prompt) + new_tokens + 16, threads=threads,
                              log_path=os.path.join(logs, "llama_server.log")) as server:
            reply = httpx.post(server.url + "/completion", json=body, timeout=3600).json()
        timings = reply["timings"]
        if timings["prompt_n"] != len(prompt) or timings["predicted_n"] != new_tokens:
            raise RuntimeError(f"llama-server computed {timings['prompt_n']} of {len(prompt)} prompt "
                               f"tokens and generated {timings['predicted_n']} of {new_tokens}")
        yield timings["prompt_ms"], timings["predicted_per_second"], reply.get("tokens", [])


def llama_bench_line(bin_dir: str, gguf: str, prompt_tokens: int, new_tokens: int, repeat: int,
                     threads: int) -> str:
    import subprocess

    exe = os.path.join(bin_dir, peer.BENCH)
    if not os.access(exe, os.X_OK):
        return f"llama-bench: not built in {bin_dir}"
    command = [exe, "-m", gguf, "-p", str(prompt_tokens), "-n", str(new_tokens), "-r", str(max(repeat, 1)),
               "-t", str(threads), "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        rows = json.loads(result.stdout)
    except json.JSONDecodeError:
        return f"llama-bench failed (exit {result.returncode}): {result.stderr.strip()[-300:]}"
    parts = []
    for row in rows:
        kind = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        parts.append(f"{kind} {row['avg_ts']:.1f} tokens/s (+/- {row['stddev_ts']:.1f})")
    return (f"llama-bench -p {prompt_tokens} -n {new_tokens} -r {max(repeat, 1)} -t {threads}: "
            + ", ".join(parts))


# ------------------------------------------------------------------ report
def _kwarg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def same_prefix(tokens: list[int], reference: list[int] | None) -> str:
    if reference is None or not tokens:
        return "n/a"
    pairs = enumerate(zip(tokens, reference))
    n = next((i for i, (a, b) in pairs if a != b), min(len(tokens), len(reference)))
    return f"{n}/{len(reference)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per system, after one warm-up run")
    parser.add_argument("--systems", nargs="+", choices=("stock", "chunk-llama", "llama.cpp"),
                        default=["stock", "chunk-llama", "llama.cpp"])
    parser.add_argument("--gguf-weights", nargs="+", choices=("quantized", "dequantized"),
                        help="chunk-llama: load_model(..., gguf_weights=X), one system per value "
                             "(default: the keyword is not passed)")
    parser.add_argument("--gguf-activations", nargs="+", choices=activations.CHOICES,
                        help="chunk-llama: load_model(..., gguf_activations=X), one system per value (and per "
                             "--gguf-weights value)")
    parser.add_argument("--chunk-llama-arg", type=_kwarg, action="append", default=[], metavar="KEY=VALUE",
                        help="chunk-llama: another keyword for load_model (repeatable)")
    parser.add_argument("--stock-bfloat16", action="store_true",
                        help="also stock on the dequantized copy in bfloat16 (compare chunk-llama's "
                             "--chunk-llama-arg dtype=bfloat16)")
    parser.add_argument("--torchao", choices=("int4", "int8"),
                        help="also stock and chunk-llama on the dequantized copy with torchao's weight-only "
                             "quantization (int4: groups of 32, torchao's CPU layout), its activations in "
                             "--torchao-dtype: systems stock (torchao X) and chunk-llama (torchao X)")
    parser.add_argument("--torchao-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="activations of the torchao systems (torchao's CPU int4 kernel is made for "
                             "bfloat16: with float32 a 300-token prefill took 25 s)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads for torch and llama.cpp (default: torch's)")
    parser.add_argument("--model", default=None, help="a .gguf file or gemma3-270m (default: the default model's)")
    parser.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp first if not cached")
    parser.add_argument("--llama-bench", action="store_true", help="also llama-bench -p/-n figures")
    parser.add_argument("--interleave", action="store_true",
                        help="alternate one run of chunk-llama and one of llama.cpp per round (this host's speed "
                             "drifts within minutes: a paired comparison), all loaded at once; stock runs first")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # the file itself, which llama.cpp needs (load_model also takes the gemma3-270m alias)
    gguf = model_path(args.model)
    runs = args.repeat + 1

    rows, reference, tokenizer, model = [], None, None, None
    if "stock" in args.systems:  # stock's: transformers' float32 copy (32 GB at 8B: only when asked for)
        model, tokenizer = load_model(gguf, device="cpu", dtype=torch.float32, gguf_weights="dequantized")
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    prompt = chat_prompt_ids(tokenizer, args.prompt_tokens)

    def add(name: str, results) -> None:
        nonlocal reference
        timed = results[1:]  # the first run is the warm-up
        row = {"system": name, "prefill_ms": statistics.median(r[0] for r in timed),
               "decode_tok_s": statistics.median(r[1] for r in timed), "tokens": timed[-1][2],
               "runs_prefill_ms": [round(r[0], 2) for r in timed],
               "runs_decode_tok_s": [round(r[1], 2) for r in timed]}
        if name == "stock":
            reference = row["tokens"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)

    if "stock" in args.systems:
        add("stock", run_stock(model, prompt, args.new_tokens, runs))
        if args.stock_bfloat16:
            add("stock (bfloat16)", run_stock(copy.deepcopy(model).to(torch.bfloat16), prompt, args.new_tokens, runs))
    quantized = None
    if args.torchao:  # stock and chunk-llama on one torchao-quantized copy
        if model is None:
            model, _ = load_model(gguf, device="cpu", dtype=torch.float32, gguf_weights="dequantized")
        quantized = torchao_quantized(model.to(getattr(torch, args.torchao_dtype)), args.torchao)
        add(f"stock (torchao {args.torchao}, {args.torchao_dtype})",
            run_stock(quantized, prompt, args.new_tokens, runs))
    model = None  # stock's freed first
    pending = []  # (name, generator of runs): chunk-llama's forms and llama.cpp
    llama_desc, bench_line = "llama.cpp: not run", None
    try:
        if "chunk-llama" in args.systems:
            extra = dict(args.chunk_llama_arg)
            for form, acts in [(f, a) for f in args.gguf_weights or [None] for a in args.gguf_activations or [None]]:
                kwargs = dict(extra, **({"gguf_weights": form} if form else {}),
                              **({"gguf_activations": acts} if acts else {}))
                named = ", ".join(f"{k}={v}" for k, v in kwargs.items())
                name = f"chunk-llama ({named})" if kwargs else "chunk-llama"
                try:  # load_model's default form unless told
                    loaded, _ = load_model(gguf, **{"device": "cpu", "dtype": torch.float32, **kwargs})
                except (TypeError, ValueError) as error:  # e.g. a keyword this load_model does not take yet
                    rows.append(dict(system=name, error=f"{type(error).__name__}: {str(error)[:200]}"))
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                pending.append((name, chunk_llama_runs(loaded, tokenizer, prompt, args.new_tokens)))
            if quantized is not None:
                pending.append((f"chunk-llama (torchao {args.torchao}, {args.torchao_dtype})",
                                chunk_llama_runs(quantized, tokenizer, prompt, args.new_tokens)))
        if "llama.cpp" in args.systems:
            try:
                bin_dir = peer.find_bin(build=args.build_llama_cpp)
                llama_desc = peer.describe(bin_dir)
                logs = tempfile.mkdtemp(prefix="bench_single_")
                pending.append(("llama.cpp", llama_cpp_runs(bin_dir, gguf, prompt, args.new_tokens, args.threads,
                                                            logs)))
                if args.llama_bench:
                    bench_line = llama_bench_line(bin_dir, gguf, len(prompt), args.new_tokens, args.repeat,
                                                  args.threads)
            except (peer.Unavailable, RuntimeError, OSError) as error:
                rows.append(dict(system="llama.cpp", error=str(error)[:300]))
                print(json.dumps(rows[-1]), flush=True)
        if args.interleave:  # a warm-up each, then one run of each system per round
            results = {name: [next(runs_of)] for name, runs_of in pending}
            for _ in range(args.repeat):
                for name, runs_of in pending:
                    results[name].append(next(runs_of))
            for name, _ in pending:
                add(name, results[name])
        else:  # each system's runs together, one system after the other
            for name, runs_of in pending:
                add(name, [next(runs_of) for _ in range(runs)])
                runs_of.close()
    finally:
        for _, runs_of in pending:
            runs_of.close()

    from chunk_llama.ops.cpu.isa import selected_variant

    header = (f"one request: {len(prompt)}-token chat prompt, {args.new_tokens} new tokens, greedy, "
              f"{os.path.basename(gguf)}, {args.threads} threads, median of {args.repeat} runs "
              f"after a warm-up{' (interleaved)' if args.interleave else ''}\n{peer.cpu_summary()}; chunk-llama variant {selected_variant()}; torch "
              f"{torch.__version__}; {llama_desc}")
    print("\n" + header + "\n")
    print(table(rows, reference))
    if bench_line:
        print("\n" + bench_line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, prompt_ids=prompt, rows=rows, llama_bench=bench_line), f, indent=2)


def table(rows: list[dict], reference: list[int] | None) -> str:
    by_name = {r["system"]: r for r in rows if "error" not in r}
    lines = [("| system | prefill ms | decode tokens/s | decode vs llama.cpp | decode vs stock "
              "| prefill vs llama.cpp | prefill vs stock | tokens = stock's |"),
             "|---|---|---|---|---|---|---|---|"]

    def ratio(row, base, key, invert=False):
        other = by_name.get(base)
        if other is None or row is other:
            return "-"
        value = other[key] / row[key] if invert else row[key] / other[key]
        return f"{value:.2f}x"

    for row in rows:
        if "error" in row:
            lines.append(f"| {row['system']} | not run: {row['error']} |||||||")
            continue
        # prefill ratios as speed (other's ms over this one's): above 1 is faster, as for decode
        lines.append(f"| {row['system']} | {row['prefill_ms']:.1f} | {row['decode_tok_s']:.1f} | "
                     f"{ratio(row, 'llama.cpp', 'decode_tok_s')} | {ratio(row, 'stock', 'decode_tok_s')} | "
                     f"{ratio(row, 'llama.cpp', 'prefill_ms', True)} | "
                     f"{ratio(row, 'stock', 'prefill_ms', True)} | "
                     f"{same_prefix(row['tokens'], reference)} |")
    lines.append("(ratios are speeds: above 1.00x this system is faster; "
                 "tokens = stock's: leading tokens equal)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
