"""llama.cpp as a peer in the benchmarks: find the binaries `scripts/build_llama_cpp.sh` built,
start `llama-server` on a GGUF file, ask it for greedy completions, run `llama-batched-bench`.

Nothing here builds llama.cpp behind the user's back (about 10 minutes on 2 cores): `find_bin`
says why llama.cpp is unavailable (`Unavailable`), and `find_bin(build=True)` runs the build
script. The benchmarks print that reason in the row of the llama.cpp system and go on.

    bin_dir = find_bin()                       # or raises Unavailable("not built: run ...")
    with LlamaServer(bin_dir, gguf, slots=16, ctx_per_slot=2400, threads=2) as server:
        body = greedy_body(prompt_ids, n_predict=32)
        httpx.post(server.url + "/completion", json=body).json()["timings"]

The settings match the project's greedy decoding (`do_sample=False`, no repetition penalty):
temperature 0 with `top_k` 1 as the only other sampler, every penalty off. `ignore_eos` makes
every system generate the same number of tokens; llama.cpp implements it as a -inf bias on the
end-of-generation tokens, as `min_new_tokens` does in transformers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
BUILD_SCRIPT = os.path.join(SCRIPTS, "build_llama_cpp.sh")
SERVER, BATCHED_BENCH, BENCH = "llama-server", "llama-batched-bench", "llama-bench"


class Unavailable(RuntimeError):
    """llama.cpp cannot run here; the message says why (and how to fix it)."""


def peers_dir() -> str:
    return os.environ.get("CHUNK_LLAMA_PEERS_DIR") or os.path.expanduser("~/.cache/chunk_llama/peers")


def pinned_version() -> str | None:
    """The llama-cpp-python sdist version the build script builds by default."""
    try:
        with open(BUILD_SCRIPT, encoding="utf-8") as f:
            match = re.search(r"^DEFAULT_VERSION=(\S+)", f.read(), re.M)
    except OSError:
        return None
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION")
    return version if version and version != "latest" else (match.group(1) if match else None)


def _has_binaries(bin_dir: str) -> bool:
    return all(os.access(os.path.join(bin_dir, name), os.X_OK) for name in (SERVER, BATCHED_BENCH))


def find_bin(build: bool = False) -> str:
    """The folder holding llama-server and llama-batched-bench: `$LLAMA_CPP_BIN` if set, else
    the build of the pinned sdist version in `peers_dir()`, else any other cached native build
    (newest version first; an AVX2 build, `LLAMA_CPP_ISA=avx2`, only by `$LLAMA_CPP_BIN`).
    `build=True` runs scripts/build_llama_cpp.sh when none is found."""
    override = os.environ.get("LLAMA_CPP_BIN")
    if override:
        if _has_binaries(override):
            return override
        raise Unavailable(f"LLAMA_CPP_BIN={override} holds no {SERVER} and {BATCHED_BENCH}")
    candidates = []
    pinned = pinned_version()
    if pinned:
        candidates.append(os.path.join(peers_dir(), f"llama.cpp-{pinned}", "bin"))
    if os.path.isdir(peers_dir()):
        # (not a build held to an ISA, llama.cpp-<version>-avx2: LLAMA_CPP_BIN names it where wanted)
        others = [d for d in os.listdir(peers_dir()) if d.startswith("llama.cpp-") and "." in d[10:]
                  and "-" not in d[10:] and not d.endswith((".lock", ".tmp"))]
        others.sort(key=lambda d: [int(p) if p.isdigit() else 0 for p in d[10:].split(".")], reverse=True)
        candidates += [os.path.join(peers_dir(), d, "bin") for d in others]
    for candidate in candidates:
        if _has_binaries(candidate):
            return candidate
    if not build:
        raise Unavailable(f"not built: run scripts/build_llama_cpp.sh (cmake, about 10 min on 2 cores; "
                          f"binaries go to {peers_dir()}), or pass --build-llama-cpp")
    return build_now()


def build_now() -> str:
    """Run scripts/build_llama_cpp.sh (its log on stderr); its last stdout line is the bin folder."""
    if shutil.which("cmake") is None:
        raise Unavailable("cannot build: cmake not found (apt-get install cmake)")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise Unavailable("cannot build: no C++ compiler found")
    result = subprocess.run(["bash", BUILD_SCRIPT], stdout=subprocess.PIPE, text=True)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not _has_binaries(lines[-1]):
        raise Unavailable(f"scripts/build_llama_cpp.sh failed (exit {result.returncode}); its log is above")
    return lines[-1]


def build_info(bin_dir: str) -> dict[str, str]:
    """build-info.txt beside the bin folder, as written by the build script ({} if absent)."""
    info = {}
    try:
        with open(os.path.join(os.path.dirname(bin_dir), "build-info.txt"), encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def describe(bin_dir: str) -> str:
    """'llama.cpp 0c1e57098 (llama-cpp-python 0.3.36 sdist, ggml 0.25.3, GGML_NATIVE)' (or 'AVX2 only')
    for table headers."""
    info = build_info(bin_dir)
    if not info:
        return f"llama.cpp from {bin_dir}"
    isa = "AVX2 only" if "-DGGML_AVX512=OFF" in info.get("flags", "") else "GGML_NATIVE"
    return (f"llama.cpp {info.get('llama.cpp commit', '?')} "
            f"(llama-cpp-python {info.get('llama-cpp-python sdist', '?')} sdist, "
            f"ggml {info.get('ggml version', '?')}, {isa})")


def greedy_body(prompt, n_predict: int, *, ignore_eos: bool = True, cache_prompt: bool = True,
                stream: bool = False) -> dict:
    """A /completion request that decodes greedily: temperature 0 and top-k 1 as the only
    samplers, no repetition/DRY/XTC penalties, exactly `n_predict` tokens with `ignore_eos`.
    `prompt` is a string or token ids (ids are used as given: no BOS is added to them)."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "ignore_eos": ignore_eos,
        "temperature": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "repeat_last_n": 0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "samplers": ["top_k", "temperature"],
        "cache_prompt": cache_prompt,
        "return_tokens": True,
        "stream": stream,
    }


class LlamaServer:
    """`llama-server` on `gguf` with `slots` parallel slots (`-np`), each with `ctx_per_slot`
    tokens of context (`-c` is their product: llama-server splits it evenly between slots),
    `threads` threads for both decode and prompt batches. A context manager; `url` once started."""

    def __init__(self, bin_dir: str, gguf: str, *, slots: int, ctx_per_slot: int, threads: int,
                 log_path: str, extra_args: tuple[str, ...] = (), timeout: float = 300):
        self.bin_dir, self.gguf, self.slots, self.threads = bin_dir, gguf, slots, threads
        self.ctx_per_slot = ctx_per_slot
        self.log_path, self.extra_args, self.timeout = log_path, tuple(extra_args), timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        return [
            os.path.join(self.bin_dir, SERVER), "-m", self.gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(self.slots), "-c", str(self.slots * self.ctx_per_slot),
            "-t", str(self.threads), "-tb", str(self.threads),
            "--no-webui",  # built without its web UI (no npm, no download at build time)
            *self.extra_args,
        ]

    def start(self) -> LlamaServer:
        import httpx

        from chunk_llama.server.replicas import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = self.command(port)
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        except OSError as error:
            raise Unavailable(f"{SERVER} did not start: {error}") from error
        finally:
            log.close()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        code = self.proc.poll()
        self.stop()
        raise Unavailable(f"{SERVER} {'exited with ' + str(code) if code is not None else 'timed out'}: "
                          f"{self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def batched_bench(bin_dir: str, gguf: str, *, prompt_tokens: int, new_tokens: int, parallel: int,
                  threads: int, shared: bool = True, timeout: float = 3600) -> dict:
    """One `llama-batched-bench` point: `parallel` sequences of `new_tokens` after a
    `prompt_tokens` prompt (random tokens), shared (`-pps`: computed once; `-kvu`: one KV buffer,
    so the prompt's K/V are not copied per sequence either) or one prompt per sequence.
    Returns its JSONL row: t_pp, speed_pp (prompt tokens/s), t_tg, speed_tg (generated tokens/s
    over all sequences), t, speed, n_kv, ..."""
    n_kv = (prompt_tokens if shared else parallel * prompt_tokens) + parallel * new_tokens
    ctx = -(-(n_kv + 1) // 256) * 256  # llama.cpp pads the context to 256
    command = [
        os.path.join(bin_dir, BATCHED_BENCH), "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
        "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", str(parallel),
        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl",
    ]
    if shared:
        command += ["-pps", "-kvu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not rows:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise Unavailable(f"{BATCHED_BENCH} failed (exit {result.returncode}): {tail}")
    return {**rows[-1], "command": " ".join(command[1:])}


def cpu_summary() -> str:
    """'AMD EPYC, 2 CPUs, avx2 avx512f avx512_bf16' (the ISA flags that matter here)."""
    from chunk_llama.ops.cpu.isa import _cpu_flags, cpu_model

    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    flags = [f for f in wanted if f in _cpu_flags()]
    return f"{cpu_model()}, {os.cpu_count()} CPUs, flags: {' '.join(flags) or 'none of ' + '/'.join(wanted)}"
