"""The code's shape (issues 10, 24): imports only go downwards through the layers, and
functions stay short.

Both walk the source with ``ast``, so they see function-level imports too: an import
moved into a function to dodge a cycle is still a cycle here. Imports under
``if TYPE_CHECKING:`` run only for a type checker and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "superfluid"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's superfluid imports, with every package an import runs on the way
    (importing a.b.c runs a/__init__ and a/b/__init__ first)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_nodes(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if not t.startswith("superfluid"):
                    continue
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    if name in mods and name != mod and not mod.startswith(name + "."):
                        graph[mod].add(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_imports(_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# The layers, lowest first (DESIGN.md §9). A module may import its own layer or a lower
# one, never a higher one. A module belongs to the layer of its longest prefix listed here.
LAYERS: list[tuple[str, ...]] = [
    # leaves: records and codes (abi), page arithmetic, model names, the GGUF header
    # reader, the tokenizer's protocol, Vocabulary, the sampling primitives the runtimes,
    # executor and engine share, and the web UI's static files. They import no other layer.
    ("superfluid.abi", "superfluid.pages", "superfluid.models", "superfluid.gguf_header",
     "superfluid.tokenizer_api", "superfluid.vocabulary", "superfluid.sampling", "superfluid.web"),
    # the token / logits rings and text <-> ids: built on the records and the vocabulary
    ("superfluid.rings", "superfluid.tokenizer"),
    # runtimes: a model's forward pass and in-runtime sampling; they never see the executor
    ("superfluid.runtimes",),
    # the executor: the tick phases over one runtime
    ("superfluid.executor",),
    # the worker: the supervised process (executor + runtime) and its wire
    ("superfluid.worker",),
    # the engine: requests, scheduling, text; the engine the server and LLM drive
    ("superfluid.engine",),
    # the OpenAI front door over one engine (anything that is a ServingEngine)
    ("superfluid.server",),
    # replicas on Ray behind the same front door
    ("superfluid.cluster",),
    # what users call: the package root (``from superfluid import LLM``), the command
    # line, ``superfluid bench`` and LLM (entrypoints/)
    ("superfluid", "superfluid.cli", "superfluid.bench", "superfluid.entrypoints"),
]

# Upward imports tolerated for now, "importer -> imported": none. An entry needs a comment
# saying why it cannot move yet.
KNOWN_UPWARD: frozenset[str] = frozenset()


def _layer(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int | None:
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    return None if best is None else best[0]


def _upward(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import from a module to a module of a higher layer, as "importer -> imported"."""
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if _layer(t, layers) > _layer(m, layers))


def test_every_module_has_a_layer():
    assert [m for m in _modules() if _layer(m) is None] == []


def test_no_import_goes_up_a_layer():
    found = set(_upward(_imports(_modules())))
    assert sorted(found - KNOWN_UPWARD) == []
    assert sorted(KNOWN_UPWARD - found) == [], "a known exception is gone: drop it from KNOWN_UPWARD"


def test_the_layer_check_finds_an_upward_import():
    layers = [("p.low",), ("p.mid",), ("p", "p.top")]
    graph = {"p.low.a": {"p.low.b"}, "p.low.b": set(), "p.mid": {"p.low.a"},
             "p.top.x": {"p.mid", "p.low.b"}, "p": {"p.top.x"}}
    assert _upward(graph, layers) == []
    graph["p.low.b"] = {"p.mid.c"}  # a leaf reaching up, lazily or not, is caught
    graph["p.mid"] = {"p.low.a", "p"}  # so is the package root, which is the top layer
    assert _upward(graph, layers) == ["p.low.b -> p.mid.c", "p.mid -> p"]


def _long_functions() -> list[str]:
    out = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_sixty_lines():
    assert _long_functions() == []


@pytest.mark.parametrize("module", ["superfluid.executor.tick", "superfluid.executor.decode"])
def test_the_tick_phases_never_see_the_executor(module):
    """The phases work on the TickContext; only executor.py knows the Executor."""
    path = _modules()[module]
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "Executor" not in names
