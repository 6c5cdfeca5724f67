import os
import sys

import psutil

sys.path.insert(0, os.path.dirname(__file__))
# Every test that compares with stock transformers runs GGUF blocks on float32 activations (the
# dequantized model's numbers); the int8 path's tests ask for it (tests/test_quant_act.py). Set
# for the whole run, so that subprocesses (the commands, the server) inherit it.
os.environ["CHUNK_LLAMA_GGUF_ACTIVATIONS"] = "float32"


def pytest_sessionfinish(session, exitstatus):
    """Kill what a failed test may have left running (a server, a router, a launcher): a process
    that outlives the run keeps its pipes open, and CI would wait for it until its own time limit."""
    leftovers, names = psutil.Process().children(recursive=True), []
    for proc in leftovers:
        try:
            names.append(" ".join(proc.cmdline())[:160])
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if leftovers and reporter is not None:
        reporter.write_line("conftest: killed what the tests left running: " + "; ".join(names), yellow=True)
