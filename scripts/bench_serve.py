"""Serving benchmark over HTTP: `chunk-llama serve` (and `transformers serve
--continuous-batching`, if it runs here) against `engine.generate` on the same requests.

    python scripts/bench_serve.py --workload shared --num-clients 16 --max-new-tokens 32     # the 0.9x target
    python scripts/bench_serve.py --workload toolqa --limit 8 --rps 2 --num-clients 16
    python scripts/bench_serve.py --workload shared --num-requests 4 --n-shared 200 --max-new-tokens 8
    python scripts/bench_serve.py --json-schema-ab 3       # constrained decoding's cost (below)
    python scripts/bench_serve.py --workload shared --num-clients 16 --max-new-tokens 32 \
        --ignore-eos --systems generate http llama.cpp      # against llama.cpp on the same GGUF
    python scripts/bench_serve.py --workload shared --systems generate http --api chat responses \
        --ignore-eos                                        # the Responses API against chat completions
    python scripts/bench_serve.py --model llama-1b-q4km.gguf --gguf-activations int8 --ignore-eos \
        --systems generate llama.cpp                        # another GGUF file (scripts/synthetic_gguf.py)

Workloads (chat requests, greedy):
  shared   `--num-requests` chats whose system prompt is `--n-shared` tokens of the shipped tool
           manual, then a short question each (the 16 x 2,000 workload of scripts/bench_e2e.py)
  toolqa   the shipped ToolQA-style prompt set (`--limit` questions per application)
Clients: requests arrive by a Poisson process at `--rps` (inf: all at once), at most
`--num-clients` in flight; each streams its answer (`/v1/chat/completions`, stream=true).
Metrics per system: throughput (generated tokens over the time from the first arrival
to the last finish), TTFT p50/p99 (from arrival), inter-token latency p50/p99 (gaps
between streamed chunks), greedy outputs equal to `engine.generate`'s.

Systems:
  http       `chunk-llama serve` in a subprocess (same model, batch size and KV budget), once per
             `--api`: `chat` streams `/v1/chat/completions`, `responses` streams `/v1/responses`
             (the system prompt as `instructions`, the question as `input`: the same prompt);
             each API gets a fresh server and the same warm-up, and the table adds the ratio
  generate   `engine.generate` on the same chats in this process, all submitted at the
             arrival times (rps inf: one `generate` call; else the online API)
  hf-serve   `transformers serve --continuous-batching` on the same model saved to a local
             folder (no download); skipped with the reason when it cannot start
  llama.cpp  `llama-server -np <num-clients>` (built by scripts/build_llama_cpp.sh, or with
             `--build-llama-cpp`) on the same GGUF file, `--threads` threads, each slot's context
             the longest prompt plus the new tokens; every chat goes as the token ids our
             tokenizer's chat template gives (so the prompts are the same tokens), streamed from
             its `/completion` with the same greedy settings (temperature 0, top-k 1, no
             penalties; see scripts/llama_cpp_peer.py). Skipped with the reason when not built or
             it cannot start. On the shared workload a second line gives llama.cpp's best case,
             `llama-batched-bench -pps -kvu`: the prompt (random tokens of the mean prompt length)
             computed once, its K/V shared by `--num-clients` sequences, their decode tokens/s.
`--ignore-eos` makes every request generate exactly `--max-new-tokens` (generate, http and
llama.cpp; `transformers serve` refuses the field, so hf-serve's requests may end early).
The server is idle while `generate` runs and the other way round; each system gets the
same warm-up request (the first chat, 2 tokens), so every system starts with the shared
prefix of the first request cached the same way.
`--json-schema-ab ROUNDS` measures instead what structured output costs: `engine.generate` on
the workload in this process, every request unconstrained (A) or under the JSON schema
`ANSWER_SCHEMA` (B), A, B, A, B, ... for ROUNDS rounds, each run on a fresh engine given the
same warm-up (2 tokens of the first chat, under the schema); throughput (generated tokens over wall time) per run, the medians, and the
median of the rounds' B/A ratios. Both generate exactly `--max-new-tokens` per request, so
the batch is the same at every step: the config's EOS is an id the model does not produce
here (checked), so a B request whose document is complete goes on taking the only token its
grammar then allows (the model's EOS, a special token: the text stays the document, which is
validated), every step under its grammar. Otherwise A's requests end at other times than B's
and the batch shrinks differently, which changes a step's cost more than the grammar does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from transformers import GenerationConfig

import chunk_llama
from chunk_llama.cli import DEFAULT_PROMPTS, DEFAULT_SYSTEM, read_prompts
from chunk_llama.loading import model_path
from chunk_llama.server.replicas import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp_peer as peer  # noqa: E402
from bench_e2e import poisson_arrivals  # noqa: E402  (the same arrivals as the e2e benchmark)

SYSTEMS = ("http", "generate", "hf-serve", "llama.cpp")
ANSWER_SCHEMA = {  # an answer to a tool-manual question
    "type": "object",
    "properties": {"tool": {"type": "string"}, "arguments": {"type": "array", "items": {"type": "string"}},
                   "reason": {"type": "string"}},
    "required": ["tool", "arguments", "reason"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------ workloads
def shared_chats(tokenizer, n_shared: int, num_requests: int) -> list[list[dict]]:
    """The bench_e2e chat workload: `n_shared` tokens of the tool manual, then a question each."""
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        manual = tokenizer(f.read())["input_ids"]
    while len(manual) < n_shared:
        manual = manual + manual
    system = tokenizer.decode(manual[:n_shared])
    questions = read_prompts(DEFAULT_PROMPTS)
    return [
        [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": questions[i % len(questions)] + ("" if i < len(questions) else f" (case {i})"),
            },
        ]
        for i in range(num_requests)
    ]


def toolqa_chats(limit: int | None) -> list[list[dict]]:
    """The shipped ToolQA-style set as chats (system prompt, few-shot turns if any, question)."""
    from chunk_llama.eval import data as eval_data
    from chunk_llama.eval import load_prompt_set

    parse = getattr(eval_data, "parse_few_shot", lambda value: [])
    rows = load_prompt_set("toolqa", limit=limit)
    return [
        [
            {"role": "system", "content": r["system_prompt"]},
            *parse(r.get("few_shot")),
            {"role": "user", "content": r["question"]},
        ]
        for r in rows
    ]



# ------------------------------------------------------------------ servers
def start_server(command: list[str], url: str, timeout: float, log_path: str, env=None) -> subprocess.Popen:
    """Start a server and wait for GET /health; raises RuntimeError with its log's tail if it dies."""
    log = open(log_path, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    with open(log_path) as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"{' '.join(command[:4])} did not become healthy in {timeout:.0f} s:\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def chat_requests(model: str, chats, ignore_eos: bool = False):
    """Request i as a streamed OpenAI chat completion: (path, body)."""

    def build(i: int, max_new_tokens: int) -> tuple[str, dict]:
        body = {
            "model": model,
            "messages": chats[i],
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        return "/v1/chat/completions", body

    return build


def responses_requests(model: str, chats, ignore_eos: bool = False):
    """Request i as a streamed Responses API request of the same prompt: the chat's system
    message as `instructions`, the rest as input messages (the chat it becomes is chat i)."""

    def build(i: int, max_new_tokens: int) -> tuple[str, dict]:
        system = [m["content"] for m in chats[i] if m["role"] == "system"]
        body = {
            "model": model,
            "input": [{"role": m["role"], "content": m["content"]} for m in chats[i] if m["role"] != "system"],
            "max_output_tokens": max_new_tokens,
            "temperature": 0,
            "stream": True,
        }
        if system:
            body["instructions"] = system[0]
        if ignore_eos:
            body["ignore_eos"] = True
        return "/v1/responses", body

    return build


def llama_requests(prompt_ids: list[list[int]], ignore_eos: bool):
    """Request i as a streamed llama-server /completion of our chat's token ids, greedy."""

    def build(i: int, max_new_tokens: int) -> tuple[str, dict]:
        body = peer.greedy_body(prompt_ids[i], max_new_tokens, ignore_eos=ignore_eos, stream=True)
        return "/completion", body

    return build


def _event_delta(event: dict) -> tuple[list[str], dict | None]:
    """(texts, usage) of one streamed event: OpenAI's chunks, the Responses API's events, or
    llama-server's /completion ones (`content` per token; the last, `stop: true`, counts the tokens)."""
    kind = event.get("type", "")
    if kind.startswith("response."):
        if kind == "response.output_text.delta":
            return [event["delta"]], None
        if kind in ("response.completed", "response.incomplete"):
            return [], {"completion_tokens": event["response"]["usage"]["output_tokens"]}
        return [], None
    if "choices" in event or "usage" in event:
        texts = [(c.get("delta") or {}).get("content") for c in event.get("choices", [])]
        return [t for t in texts if t], event.get("usage")
    usage = {"completion_tokens": event["tokens_predicted"]} if event.get("stop") else None
    return ([event["content"]] if event.get("content") else []), usage


async def run_clients(url: str, request_of, num_requests: int, arrivals, max_new_tokens: int,
                      num_clients: int, tokenizer):
    """Stream requests 0..num_requests-1 (`request_of(i, max_new_tokens)` gives the path and
    body) at their arrival times, at most `num_clients` at once; one record each."""
    limit = asyncio.Semaphore(num_clients)
    start = time.perf_counter()
    records = [None] * num_requests

    async def one(i, client):
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        arrival = time.perf_counter()
        async with limit:
            path, body = request_of(i, max_new_tokens)
            chunks, text, usage = [], [], None
            async with client.stream("POST", url + path, json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {response.status_code}: {await response.aread()}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"request {i}: {event['error']}")
                    contents, event_usage = _event_delta(event)
                    usage = event_usage or usage
                    for content in contents:
                        chunks.append(time.perf_counter())
                        text.append(content)
            finish = time.perf_counter()
        text = "".join(text)
        n = (
            usage["completion_tokens"]
            if usage
            else len(tokenizer(text, add_special_tokens=False)["input_ids"])
        )
        records[i] = dict(
            arrival=arrival,
            first=chunks[0] if chunks else finish,
            finish=finish,
            tokens=n,
            text=text,
            gaps=[b - a for a, b in zip(chunks, chunks[1:])],
        )

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        await asyncio.gather(*(one(i, client) for i in range(num_requests)))
    return records


def http_run(url, request_of, num_requests, arrivals, args, tokenizer):
    asyncio.run(run_clients(url, request_of, 1, [0.0], 2, 1, tokenizer))  # warm-up
    return asyncio.run(
        run_clients(url, request_of, num_requests, arrivals, args.max_new_tokens, args.num_clients, tokenizer)
    )


# ------------------------------------------------------------------ in-process reference
def generate_run(engine, chats, arrivals, max_new_tokens: int, ignore_eos: bool = False):
    """`engine.generate` (rps inf) or the online API at the same arrival times; one record each."""
    # ignore_eos as `chunk-llama serve` does it: no id ends the text
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              **({"eos_token_id": []} if ignore_eos else {}))
    engine.generate(chats[:1], GenerationConfig(max_new_tokens=2, do_sample=False))  # warm-up
    start = time.perf_counter()
    if all(a == 0 for a in arrivals):
        outputs = engine.generate(chats, config)
    else:
        outputs, request_of, next_i = [None] * len(chats), {}, 0
        while next_i < len(chats) or engine.has_unfinished_requests():
            while next_i < len(chats) and start + arrivals[next_i] <= time.perf_counter():
                request_of[engine.add_request(chats[next_i], config)] = next_i
                next_i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + arrivals[next_i] - time.perf_counter()))
                continue
            for delta in engine.step():
                if delta.finished:
                    outputs[request_of[delta.request_id]] = delta.output
    return [
        dict(
            arrival=start + a,
            first=o.first_token_time,
            finish=o.finish_time,
            tokens=len(o.token_ids),
            text=o.text,
            gaps=None,
            token_ids=o.token_ids,
        )
        for o, a in zip(outputs, arrivals)
    ]


def json_schema_ab(model, tokenizer, chats, args) -> None:
    """Unconstrained (A) against every request under ANSWER_SCHEMA (B), interleaved (see module doc)."""
    import statistics

    import jsonschema

    complete = 0
    never = model.config.vocab_size - 1  # as EOS: every request runs to max_new_tokens (checked below)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=never)
    grammar = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    rates: dict[str, list[float]] = {"A": [], "B": []}
    print("| round | run | tokens | wall s | tokens/s |\n|---|---|---|---|---|")
    for round_index in range(args.json_schema_ab):
        for run, constraint in (("A", None), ("B", grammar)):
            engine = chunk_llama.ChunkLlamaEngine(model, tokenizer, max_batch_size=args.max_batch_size,
                                                  kv_cache_bytes=args.kv_cache_bytes)
            # the same warm-up for both: it also builds the engine's one-time llguidance view of the
            # tokenizer (0.3 s for this vocabulary; `chunk-llama serve` builds it at start-up)
            engine.generate(chats[:1], GenerationConfig(max_new_tokens=2, do_sample=False), grammar=grammar)
            start = time.perf_counter()
            outputs = engine.generate(chats, config, grammar=constraint)
            wall = time.perf_counter() - start
            engine.close()
            tokens = sum(len(o.token_ids) for o in outputs)
            assert tokens == len(chats) * args.max_new_tokens, "a request ended early: the batches would differ"
            for out in outputs if constraint else []:  # a complete document is valid, else one begun
                try:
                    document = json.loads(out.text)
                except json.JSONDecodeError:
                    assert out.text.startswith('{"tool":"'), out.text
                    continue
                jsonschema.validate(document, ANSWER_SCHEMA)
                complete += 1
            rates[run].append(tokens / wall)
            print(f"| {round_index + 1} | {run} | {tokens} | {wall:.2f} | {tokens / wall:.1f} |", flush=True)
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    print(f"\nmedian tokens/s: unconstrained {statistics.median(rates['A']):.1f}, json_schema "
          f"{statistics.median(rates['B']):.1f}; median ratio {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); constrained documents complete and valid: "
          f"{complete} of {len(ratios) * len(chats)} (the rest cut by the length)")


# ------------------------------------------------------------------ figures
def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summarize(system, records, reference_texts) -> dict:
    span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    ttft = [r["first"] - r["arrival"] for r in records]
    if records[0]["gaps"] is None:  # generate: mean gap per request (no per-token times)
        gaps = [(r["finish"] - r["first"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    else:
        gaps = [g for r in records for g in r["gaps"]]
    equal = sum(r["text"] == t for r, t in zip(records, reference_texts)) if reference_texts else None
    return dict(
        system=system,
        requests=len(records),
        tokens=tokens,
        wall_s=round(span, 3),
        throughput_tok_s=round(tokens / span, 2),
        ttft_p50_s=pct(ttft, 0.5),
        ttft_p99_s=pct(ttft, 0.99),
        itl_p50_s=pct(gaps, 0.5),
        itl_p99_s=pct(gaps, 0.99),
        equal_to_generate=equal,
    )


def table(rows, header) -> str:
    base = next((r["throughput_tok_s"] for r in rows if r["system"] == "generate"), None)
    fmt = lambda v: "n/a" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    lines = [
        header,
        "",
        "| system | tokens/s | vs generate | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | = generate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | not run: {r['error']} |||||||")
            continue
        ratio = f"{r['throughput_tok_s'] / base:.2f}x" if base else "n/a"
        equal = "n/a" if r["equal_to_generate"] is None else f"{r['equal_to_generate']}/{r['requests']}"
        lines.append(
            f"| {r['system']} | {r['throughput_tok_s']:.1f} | {ratio} | {fmt(r['ttft_p50_s'])} | "
            f"{fmt(r['ttft_p99_s'])} | {fmt(r['itl_p50_s'])} | {fmt(r['itl_p99_s'])} | {equal} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=("shared", "toolqa"), default="shared")
    parser.add_argument("--num-requests", type=int, default=16, help="shared workload: requests")
    parser.add_argument("--n-shared", type=int, default=2000, help="shared workload: system prompt tokens")
    parser.add_argument("--limit", type=int, default=None, help="toolqa: questions per application")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rps", type=float, default=math.inf, help="Poisson arrival rate (inf: all at once)")
    parser.add_argument("--num-clients", type=int, default=16, help="most requests in flight")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--api", nargs="+", choices=("chat", "responses"), default=["chat"],
                        help="the http system's API(s), each on a fresh server (see above)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--model", default=None,
                        help="a .gguf file or gemma3-270m, for every system (default: the default model)")
    parser.add_argument("--gguf-activations", default=None,
                        help="chunk-llama's --gguf-activations (generate and http; default: its own default)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-timeout", type=float, default=600, help="seconds for a server to start")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads of torch (here and in `chunk-llama serve`) and llama.cpp "
                             "(default: torch's)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request generates exactly --max-new-tokens (not hf-serve: see above)")
    parser.add_argument("--build-llama-cpp", action="store_true",
                        help="build llama.cpp (scripts/build_llama_cpp.sh, minutes) if it is not cached")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--json-schema-ab", type=int, default=0, metavar="ROUNDS",
                        help="measure structured output's cost instead (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = chunk_llama.load_model(args.model, dtype=getattr(torch, args.dtype),
                                              gguf_activations=args.gguf_activations)
    chats = (
        shared_chats(tokenizer, args.n_shared, args.num_requests)
        if args.workload == "shared"
        else toolqa_chats(args.limit)
    )
    if args.json_schema_ab:
        return json_schema_ab(model, tokenizer, chats, args)
    arrivals = poisson_arrivals(args.rps, len(chats), args.seed)
    rows, reference = [], None
    logs = tempfile.mkdtemp(prefix="bench_serve_")
    if "hf-serve" in args.systems:  # transformers' own float32 load (the engine's model holds GGUF blocks)
        stock = chunk_llama.load_model(args.model, dtype=getattr(torch, args.dtype), gguf_weights="dequantized")[0]
        save_local_copy(stock, tokenizer, os.path.join(logs, "model"))
        del stock
    engine = chunk_llama.ChunkLlamaEngine(
        model, tokenizer, max_batch_size=args.max_batch_size, kv_cache_bytes=args.kv_cache_bytes
    )
    if "generate" in args.systems or "http" in args.systems:
        records = generate_run(engine, chats, arrivals, args.max_new_tokens, args.ignore_eos)
        reference = [r["text"] for r in records]
        if "generate" in args.systems:
            rows.append(summarize("generate", records, reference))
            print(json.dumps(rows[-1]), flush=True)
    prompt_ids = [engine.tokenize(c) for c in chats]
    lengths = [len(p) for p in prompt_ids]
    engine.close()
    for api in args.api if "http" in args.systems else ():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable,
            "-m",
            "chunk_llama.cli",
            "serve",
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--max-batch-size",
            str(args.max_batch_size),
            "--kv-cache-bytes",
            str(args.kv_cache_bytes),
            *(["--model", args.model] if args.model else []),
            *(["--gguf-activations", args.gguf_activations] if args.gguf_activations else []),
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # torch's intra-op threads there
        log_path = os.path.join(logs, f"chunk_llama_serve_{api}.log")
        proc = start_server(command, url, args.server_timeout, log_path, env)
        try:
            name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            build = chat_requests if api == "chat" else responses_requests
            requests = build(name, chats, args.ignore_eos)
            records = http_run(url, requests, len(chats), arrivals, args, tokenizer)
            rows.append(summarize("http" if api == "chat" else f"http {api}", records, reference))
        finally:
            stop_server(proc)
        print(json.dumps(rows[-1]), flush=True)
    if "hf-serve" in args.systems:
        rows.append(hf_serve_row(chats, arrivals, args, tokenizer, reference, logs))
        print(json.dumps(rows[-1]), flush=True)
    best_case, llama_desc = None, ""
    if "llama.cpp" in args.systems:
        row, best_case, llama_desc = llama_cpp_rows(prompt_ids, arrivals, args, tokenizer, reference, logs)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    header = (
        f"{args.workload}: {len(chats)} chat requests (prompts {min(lengths)}-{max(lengths)} tokens), "
        f"{args.max_new_tokens} new tokens{' (EOS ignored)' if args.ignore_eos else ''}, greedy, "
        f"rps {args.rps:g}, "
        f"{args.num_clients} clients, {args.dtype}, "
        f"{os.path.basename(args.model) if args.model else 'SmolLM2-135M-Instruct'}"
        f"{', gguf_activations ' + args.gguf_activations if args.gguf_activations else ''}, torch {torch.__version__}, "
        f"{args.threads} threads; {peer.cpu_summary()}{'; ' + llama_desc if llama_desc else ''}"
    )
    print("\n" + table(rows, header))
    by_system = {r["system"]: r for r in rows if "error" not in r}
    if "http" in by_system and "http responses" in by_system:
        ratio = by_system["http responses"]["throughput_tok_s"] / by_system["http"]["throughput_tok_s"]
        print(f"\nResponses API / chat completions throughput: {ratio:.3f}x")
    if best_case is not None:
        print("\n" + best_case_line(best_case))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, "llama_cpp_shared_prompt_best_case": best_case}, f,
                      indent=2)


def llama_cpp_rows(prompt_ids, arrivals, args, tokenizer, reference, logs) -> tuple[dict, dict | None, str]:
    """`llama-server -np <num-clients>` on the model's GGUF file, the chats as our token ids;
    then (shared workload) `llama-batched-bench -pps` at the mean prompt length. Returns the row,
    the best case (None if not run; {"error": ...} if it failed) and a description of the build."""
    try:
        bin_dir = peer.find_bin(build=args.build_llama_cpp)
    except peer.Unavailable as error:
        return dict(system="llama.cpp", error=str(error)), None, ""
    gguf = model_path(args.model)
    slots = min(args.num_clients, len(prompt_ids))
    name = f"llama.cpp -np {slots}"
    server = peer.LlamaServer(bin_dir, gguf, slots=slots, threads=args.threads,
                              ctx_per_slot=max(len(p) for p in prompt_ids) + args.max_new_tokens + 16,
                              log_path=os.path.join(logs, "llama_server.log"), timeout=args.server_timeout)
    try:
        with server:
            requests = llama_requests(prompt_ids, args.ignore_eos)
            records = http_run(server.url, requests, len(prompt_ids), arrivals, args, tokenizer)
            row = summarize(name, records, reference)
    except (peer.Unavailable, RuntimeError, OSError) as error:
        row = dict(system=name, error=str(error)[:300])
    best_case = None
    if args.workload == "shared":
        prompt = round(statistics.mean(len(p) for p in prompt_ids))
        try:
            best_case = peer.batched_bench(bin_dir, gguf, prompt_tokens=prompt,
                                           new_tokens=args.max_new_tokens, parallel=slots,
                                           threads=args.threads)
        except (peer.Unavailable, subprocess.TimeoutExpired, OSError) as error:
            best_case = dict(error=str(error)[:300])
    return row, best_case, peer.describe(bin_dir)


def best_case_line(best: dict) -> str:
    if "error" in best:
        return f"llama.cpp shared-prompt best case (llama-batched-bench -pps): not run: {best['error']}"
    return (f"llama.cpp shared-prompt best case (llama-batched-bench -pps -kvu, the prompt computed once and "
            f"its K/V shared): {best['pl']} sequences x {best['tg']} new tokens after a {best['pp']}-token "
            f"prompt: "
            f"decode {best['speed_tg']:.1f} tokens/s, prompt {best['t_pp'] * 1e3:.0f} ms "
            f"({best['speed_pp']:.0f} tokens/s), overall {best['speed']:.1f} tokens/s "
            f"(prompt and generated tokens over {best['t']:.2f} s)")


def save_local_copy(model, tokenizer, folder: str) -> None:
    """The model as a plain local folder for `transformers serve`: a GGUF-loaded model refuses
    `save_pretrained` ("quantized with gguf and is not serializable") and `transformers serve`
    cannot load a GGUF file's config (no `architectures`), so the dequantized weights go to
    safetensors by hand, with the config (architectures set, no quantization) and tokenizer."""
    import copy

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def hf_serve_row(chats, arrivals, args, tokenizer, reference, logs) -> dict:
    """`transformers serve --continuous-batching` on the model saved to a local folder (`logs`/model)."""
    folder = os.path.join(logs, "model")
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        exe,
        "serve",
        folder,
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        args.dtype,
    ]
    try:
        proc = start_server(command, url, args.server_timeout, os.path.join(logs, "transformers_serve.log"))
    except (RuntimeError, OSError) as error:
        return dict(system="hf-serve", error=str(error).splitlines()[-1][:300])
    try:
        # the folder is the model's name (its /v1/models scans the hub cache, absent here)
        requests = chat_requests(folder, chats)  # `transformers serve` refuses ignore_eos (422)
        records = http_run(url, requests, len(chats), arrivals, args, tokenizer)
        return summarize("hf-serve", records, reference)
    except Exception as error:  # noqa: BLE001 - reported in the table
        return dict(system="hf-serve", error=f"{type(error).__name__}: {str(error)[:300]}")
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
