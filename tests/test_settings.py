"""One set of engine options (`settings.EngineArgs`) for every command: flags, help, environment."""

import os
import subprocess
import sys

import pytest
import torch

from chunk_llama import __version__
from chunk_llama.cli import build_parser, main, sampling_config
from chunk_llama.errors import UsageError
from chunk_llama.hf.support import resolve_kv_dtype
from chunk_llama.loading import resolve_device, resolve_dtype
from chunk_llama.settings import EngineArgs, from_namespace, read_chat_template


@pytest.fixture(autouse=True)
def no_activations_from_the_environment(monkeypatch):
    """conftest.py sets CHUNK_LLAMA_GGUF_ACTIVATIONS=float32 for the run (stock comparisons), which
    every parser reads as its default: these tests compare parsed defaults with the dataclass's."""
    monkeypatch.delenv("CHUNK_LLAMA_GGUF_ACTIVATIONS", raising=False)


@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_every_command_takes_the_engine_options(command):
    extra = ["--output", "out"] if command == "eval" else []
    args = build_parser().parse_args([command, "--max-batch-size", "4", "--chunk-size", "32", "--kv-cache-bytes",
                                      "1000000", "--max-prefill-tokens", "256", "--no-prefix-caching", "--dtype",
                                      "bfloat16", "--device", "cpu", "--kv-dtype", "bfloat16",
                                      "--gguf-activations", "int8", "--cuda-graphs", *extra])
    engine = from_namespace(EngineArgs, args)
    assert engine == EngineArgs(device="cpu", dtype="bfloat16", max_batch_size=4, chunk_size=32,
                                kv_cache_bytes=1000000, max_prefill_tokens=256, prefix_caching=False,
                                kv_dtype="bfloat16", gguf_activations="int8", cuda_graphs=True)
    assert engine.engine_kwargs() == dict(max_batch_size=4, chunk_size=32, kv_cache_bytes=1000000,
                                          kv_dtype="bfloat16", max_prefill_tokens=256, retain_prefixes=False,
                                          max_model_len=None, lora_modules=None, max_loras=None,
                                          max_lora_rank=None, enforce_eager=False)


def test_defaults_equal_the_dataclass_and_the_environment_overrides_them(monkeypatch):
    args = build_parser().parse_args(["serve"])
    assert from_namespace(EngineArgs, args) == EngineArgs()
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    monkeypatch.setenv("CHUNK_LLAMA_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("CHUNK_LLAMA_PREFIX_CACHING", "false")
    monkeypatch.setenv("CHUNK_LLAMA_PORT", "9001")
    args = build_parser().parse_args(["serve"])
    assert (args.max_batch_size, args.prefix_caching, args.port) == (7, False, 9001)
    assert build_parser().parse_args(["serve", "--max-batch-size", "3"]).max_batch_size == 3  # the flag wins
    monkeypatch.setenv("CHUNK_LLAMA_PORT", "eighty")
    with pytest.raises(SystemExit, match="CHUNK_LLAMA_PORT='eighty' is not a valid int"):
        build_parser()


def test_generate_takes_sampling_and_the_loader_options_serve_takes(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    loader = ["--revision", "v1", "--trust-remote-code", "--chat-template", str(template)]
    for command in ("generate", "serve", "eval"):
        extra = ["--output", "out"] if command == "eval" else []
        engine = from_namespace(EngineArgs, build_parser().parse_args([command, *loader, *extra]))
        assert (engine.revision, engine.trust_remote_code, engine.chat_template) == ("v1", True, str(template))
    assert read_chat_template(str(template)) == template.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(UsageError, match="neither a file nor a Jinja template"):
        read_chat_template("no-such-file.jinja")
    args = build_parser().parse_args(["generate", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"])
    config = sampling_config(args)
    assert (config.do_sample, config.temperature, config.top_p, args.seed) == (True, 0.7, 0.9, 3)
    assert sampling_config(build_parser().parse_args(["generate"])).do_sample is False  # temperature 0: greedy
    with pytest.raises(UsageError, match="--top-p in"):
        sampling_config(build_parser().parse_args(["generate", "--temperature", "1", "--top-p", "0"]))


def test_bare_command_prints_help_and_runs_nothing(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: chunk-llama") and "generate" in out and "serve" in out


def test_help_shows_defaults_and_environment_names_and_version():
    run = lambda *a: subprocess.run([sys.executable, "-m", "chunk_llama.cli", *a], capture_output=True, text=True,
                                    timeout=120)
    help_text = run("serve", "--help").stdout
    for text in ("--max-batch-size", "(default: 32)", "CHUNK_LLAMA_MAX_BATCH_SIZE", "--no-prefix-caching",
                 "--device", "(default: auto)", "--port"):
        assert text in help_text, text
    assert run("--version").stdout.strip() == f"chunk-llama {__version__}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where torch sees none")
def test_a_gpu_that_is_not_there_is_one_line_and_exit_code_2():
    with pytest.raises(UsageError, match="sees no CUDA GPU"):
        resolve_device("cuda:0")
    done = subprocess.run([sys.executable, "-m", "chunk_llama.cli", "generate", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # ours is one line, the last (libraries may log while they are imported: torchao does)
    message = (f"chunk-llama generate: error: device 'cuda' was asked for, but this torch ({torch.__version__}) "
               "sees no CUDA GPU; use --device cpu (or auto)")
    assert done.stderr.strip().splitlines()[-1] == message and done.stderr.count("chunk-llama") == 1


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    from chunk_llama.ops.cpu import (
        isa,  # auto on the CPU: a bfloat16 checkpoint's where the CPU computes it natively
    )

    native = isa.native_bfloat16()
    assert resolve_dtype("auto", torch.device("cpu"), torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", torch.device("cpu"), torch.float16) == torch.float32
    assert resolve_dtype("float32", torch.device("cpu"), torch.bfloat16) == torch.float32
    held = subprocess.run([sys.executable, "-c", "from chunk_llama.ops.cpu import isa; print(isa.native_bfloat16())"],
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}, capture_output=True, text=True, check=True)
    assert held.stdout.strip() == "False", "oneDNN held to AVX2 computes bfloat16 by emulation: auto stays float32"
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float64", torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16  # half the bytes, float32 attention
    assert resolve_kv_dtype("float16", torch.float32, cpu) == torch.float16
    # auto under a GGUF model's integer activations: float16 on the CPU under a float32 model only
    assert resolve_kv_dtype("auto", torch.float32, cpu, integer_activations=True) == torch.float16
    assert resolve_kv_dtype(None, None, cpu, integer_activations=True) == torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu, integer_activations=True) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, cuda, integer_activations=True) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu, integer_activations=True) == torch.bfloat16
    assert resolve_kv_dtype(torch.bfloat16, torch.bfloat16, cuda) == torch.bfloat16
    for kv_dtype, dtype, device in [("bfloat16", torch.float32, cuda), ("float32", torch.bfloat16, cpu),
                                    ("float16", torch.bfloat16, cpu), ("float16", torch.float32, cuda)]:
        with pytest.raises(ValueError, match=f"kv_dtype={kv_dtype} under a"):
            resolve_kv_dtype(kv_dtype, dtype, device)


def test_a_kv_dtype_the_model_cannot_use_is_one_line_before_any_weights_are_read():
    done = subprocess.run([sys.executable, "-m", "chunk_llama.cli", "generate", "--dtype", "bfloat16", "--kv-dtype",
                           "float16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "loading" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "chunk-llama generate: error: kv_dtype=float16 under a bfloat16 model on cpu: the K/V pool holds the "
        "model's dtype, or bfloat16 or float16 under a float32 model on the CPU")



@pytest.mark.parametrize("flags, message", [
    (["--limit", "0"], "--limit must be at least 1 (the first N prompts), got 0"),
    (["--limit", "-1"], "--limit must be at least 1 (the first N prompts), got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--max-model-len", "16"], "tokens"),  # (the engine's refusal of a prompt longer than that, loaded first)
])
def test_generate_refuses_bad_counts_in_one_line(flags, message):
    """A count that would silently drop prompts (`--limit -1` was Python's slice) or a request
    the engine refuses: one line and exit code 2, not a traceback."""
    done = subprocess.run([sys.executable, "-m", "chunk_llama.cli", "generate", *flags], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("chunk-llama generate: error: ") and message in last, last


def test_to_argv_gives_the_settings_again_and_keeps_secrets_off_command_lines():
    """What a launcher passes to the commands it starts (`--data-parallel` workers): the flags
    that parse back to the same settings; an API key is refused (ps shows command lines)."""
    from chunk_llama.server.options import DeployArgs
    from chunk_llama.settings import to_argv

    engine = EngineArgs(max_batch_size=7, prefix_caching=False, kv_cache_bytes=1 << 20, gguf_activations="float32")
    deploy = DeployArgs(max_request_bytes=4000, request_timeout=2.5, metrics_need_key=True)
    args = build_parser().parse_args(["serve", *to_argv(engine), *to_argv(deploy)])
    assert from_namespace(EngineArgs, args) == engine and from_namespace(DeployArgs, args) == deploy
    assert to_argv(EngineArgs()) == []
    with pytest.raises(ValueError, match="api_key is secret: give it to the other command in its environment"):
        to_argv(DeployArgs(api_key=["k1"]))
