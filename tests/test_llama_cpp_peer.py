"""scripts/llama_cpp_peer.py without llama.cpp: where it looks for the binaries, the reason it
gives when there are none, and the greedy request it sends (the benchmarks' fairness rests on it)."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import llama_cpp_peer as peer  # noqa: E402


def fake_build(root, version: str, commit: str = "abc1234") -> str:
    bin_dir = os.path.join(root, f"llama.cpp-{version}", "bin")
    os.makedirs(bin_dir)
    for name in (peer.SERVER, peer.BATCHED_BENCH):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(path, 0o755)
    with open(os.path.join(root, f"llama.cpp-{version}", "build-info.txt"), "w") as f:
        f.write(f"llama-cpp-python sdist: {version}\nllama.cpp commit: {commit}\nggml version: 0.1.0\n")
    return bin_dir


@pytest.fixture
def peers(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNK_LLAMA_PEERS_DIR", str(tmp_path))
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.delenv("LLAMA_CPP_PYTHON_VERSION", raising=False)
    return tmp_path


def test_not_built_says_how(peers):
    with pytest.raises(peer.Unavailable, match="not built: run scripts/build_llama_cpp.sh"):
        peer.find_bin()


def test_pinned_version_first_then_newest(peers):
    pinned = peer.pinned_version()
    assert pinned and pinned[0].isdigit()  # read from the build script's DEFAULT_VERSION
    older, newer = fake_build(peers, "0.1.9"), fake_build(peers, "0.1.10")
    assert peer.find_bin() == newer  # numeric order, not string order
    os.makedirs(os.path.join(peers, "llama.cpp-0.9.0.tmp", "bin"))  # a build in progress is no build
    assert peer.find_bin() == newer
    exact = fake_build(peers, pinned, commit="0c1e570")
    assert peer.find_bin() == exact
    assert "0c1e570" in peer.describe(exact) and pinned in peer.describe(exact)
    assert older != exact


def test_a_build_held_to_avx2_is_used_only_when_named(peers, monkeypatch):
    held = fake_build(peers, "0.3.99-avx2")
    with pytest.raises(peer.Unavailable, match="not built"):
        peer.find_bin()
    monkeypatch.setenv("LLAMA_CPP_BIN", held)
    assert peer.find_bin() == held


def test_the_build_script_refuses_an_unknown_isa(peers):
    script = os.path.join(os.path.dirname(peer.BUILD_SCRIPT), "build_llama_cpp.sh")
    result = subprocess.run(["bash", script], env={**os.environ, "LLAMA_CPP_ISA": "avx9"}, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "LLAMA_CPP_ISA must be native or avx2, got avx9" in result.stderr


def test_bin_override(peers, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_BIN", str(peers / "nowhere"))
    with pytest.raises(peer.Unavailable, match="LLAMA_CPP_BIN"):
        peer.find_bin()
    monkeypatch.setenv("LLAMA_CPP_BIN", fake_build(peers, "0.0.1"))
    assert peer.find_bin().endswith(os.path.join("llama.cpp-0.0.1", "bin"))


def test_greedy_body_is_greedy_and_fixed_length():
    body = peer.greedy_body([1, 2, 3], 64, cache_prompt=False)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 64 and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["samplers"] == ["top_k", "temperature"]
    assert body["repeat_penalty"] == 1 and body["dry_multiplier"] == 0 and body["xtc_probability"] == 0
    assert body["cache_prompt"] is False and body["return_tokens"] is True


def test_server_command_sizes_context_per_slot(tmp_path):
    server = peer.LlamaServer("/bin", "/m.gguf", slots=16, ctx_per_slot=2400, threads=2,
                              log_path=str(tmp_path / "log"))
    command = server.command(8080)
    assert command[command.index("-np") + 1] == "16" and command[command.index("-c") + 1] == str(16 * 2400)
    assert command[command.index("-t") + 1] == "2" and command[command.index("-tb") + 1] == "2"
