"""The package's imports go one way, down the layers ARCHITECTURE names, with no cycle
among them: counting every import statement (inside functions too: a cycle hidden in a
function is still a cycle of the design), and each module imports alone."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import chunk_llama

PACKAGE = Path(chunk_llama.__file__).resolve().parent
# bottom to top; a module may import its own layer's modules (without a cycle) and those below
LAYERS = (
    ("chunk_llama.version", "chunk_llama.errors", "chunk_llama.logs", "chunk_llama.extras"),
    ("chunk_llama.kv",),
    ("chunk_llama.step",),
    ("chunk_llama.ops",),
    ("chunk_llama.gguf",),
    ("chunk_llama.hf",),
    ("chunk_llama.loading",),
    ("chunk_llama.engine",),
    ("chunk_llama.settings",),
    ("chunk_llama.server", "chunk_llama.eval"),
    ("chunk_llama.cli",),
)


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _path(name: str) -> Path:
    base = PACKAGE.parent / name.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def imports_of(name: str, names: set[str], source: str | None = None) -> set[str]:
    """The chunk_llama modules `name` imports anywhere in its source: `from pkg import sub`
    is an import of the module `pkg.sub` where that is a module, of `pkg` otherwise (what
    the statement needs to run, beyond the parent packages Python imports first)."""
    path = _path(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in names else base)
    return {n for n in found if n in names and n != name}


def layer_of(name: str) -> int:
    for rank, members in enumerate(LAYERS):
        if any(name == m or name.startswith(m + ".") for m in members):
            return rank
    return len(LAYERS)  # the package's own __init__: above everything


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [nxt])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def package_graph() -> dict[str, set[str]]:
    names = set(module_names())
    return {n: imports_of(n, names) for n in names}


def test_every_module_has_a_layer():
    assert [n for n in module_names() if n != "chunk_llama" and layer_of(n) == len(LAYERS)] == []


def test_imports_go_down_the_layers():
    assert upward_imports(package_graph()) == []


def test_no_import_cycle_even_inside_functions():
    cycle = find_cycle(package_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("added, problem", [
    ("from chunk_llama.engine import ChunkLlamaEngine", "upward"),  # kv importing the engine
    ("def f():\n    from chunk_llama.kv.tree import PrefixTree", "cycle"),  # pool <-> tree, in a function
])
def test_the_checks_fail_when_an_import_breaks_the_rule(added, problem):
    names = set(module_names())
    graph = {n: imports_of(n, names) for n in names}
    source = _path("chunk_llama.kv.pool").read_text() + "\n" + added + "\n"
    graph["chunk_llama.kv.pool"] = imports_of("chunk_llama.kv.pool", names, source)
    if problem == "upward":
        assert "chunk_llama.kv.pool -> chunk_llama.engine" in upward_imports(graph)
    else:
        assert "chunk_llama.kv.tree" in graph["chunk_llama.kv.pool"] and find_cycle(graph) is not None


def test_every_module_imports_alone():
    """In a fresh interpreter, each module is imported first, with no other chunk_llama module
    loaded (the heavy libraries stay loaded between modules, to keep this fast)."""
    script = f"""
import importlib, sys, traceback
import torch, transformers
failed = []
for name in {module_names()!r}:
    for loaded in [m for m in sys.modules if m == "chunk_llama" or m.startswith("chunk_llama.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"modules that fail to import alone:\n{done.stdout}\n{done.stderr[-2000:]}"
