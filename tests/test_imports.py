"""The package's modules import without cycles: each alone, and by its module-level imports
(the layers: kv <- step <- ops <- hf <- engine <- front ends)."""

import ast
import subprocess
import sys
from pathlib import Path

import chunk_llama

PACKAGE = Path(chunk_llama.__file__).resolve().parent


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def module_level_imports(name: str, names: set[str]) -> set[str]:
    """The chunk_llama modules `name` imports when it is imported (statements at module
    level, not inside functions or `if TYPE_CHECKING:`)."""
    path = PACKAGE.parent / (name.replace(".", "/") + ("/__init__.py" if (PACKAGE.parent / name.replace(".", "/")).is_dir()
                                                       else ".py"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in names else base)
    return {n for n in found if n in names and n != name}


def test_no_cycle_among_module_level_imports():
    names = set(module_names())
    graph = {n: module_level_imports(n, names) for n in names}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(names):
        if name not in state:
            visit(name, [name])


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
