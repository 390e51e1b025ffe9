"""The import layering of DESIGN.md, checked on the source (every import, including those inside
functions and under TYPE_CHECKING), and the ownership of the index's keys and client.

- the data path (``tierstore/*.py``) never imports ``tierstore.train``, ``tierstore.cli`` or
  ``tierstore.testing``; the trainer surface (``tierstore.train``) never imports the command line
  or the test tooling: the library never imports its CLI;
- the trainer surface (``tierstore.train``) never imports the adapters (``tierstore.interop``): interop
  is built on train, never the reverse;
- ``backends/`` imports nothing of the project but ``backends``, ``tierstore.errors`` and ``tierstore.keys``;
- ``consistency/`` imports of ``tierstore`` only its leaf modules (``errors``, ``keys``): never the store;
- only ``consistency/`` spells index keys (``ts:...``) or touches the index's client (``._r``, ``._k``);
- an import inside a function says why it is lazy (``# lazy: ...`` on its line or the line before);
- one room per role: the node agent (``tierstore.agent``, a daemon) never imports the command line, and
  the benchmark harness (``tierstore.bench``, a tool like the CLI) is imported by nothing of the library;
- no import circle among the modules of a package (``tierstore.agent``, ``tierstore.cli``,
  ``tierstore.bench``), counting imports under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tierstore", "backends", "consistency")


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for every import of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child.lineno, child.module, in_func))
                # "from tierstore import codec" imports the submodule tierstore.codec
                out.extend((child.lineno, f"{child.module}.{a.name}", in_func) for a in child.names)
            visit(child, inner)

    visit(tree, False)
    return out


def _project(mod: str) -> bool:
    return mod.split(".")[0] in PACKAGES


def _violations(rule) -> list[str]:
    bad = []
    for path in _modules():
        me = _name(path)
        for line, mod, _in_func in _imports(path):
            if _project(mod) and rule(me, mod):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {mod}")
    return bad


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


DATA_PATH_FORBIDDEN = ("tierstore.train", "tierstore.interop", "tierstore.cli", "tierstore.testing", "tierstore.bench",
                       "tierstore.agent")


def test_data_path_never_imports_train_cli_or_testing():
    def rule(me: str, mod: str) -> bool:
        data_path = me.startswith("tierstore") and not _under(me, *DATA_PATH_FORBIDDEN)
        return data_path and _under(mod, *DATA_PATH_FORBIDDEN)

    assert _violations(rule) == []


TOOLS = ("tierstore.cli", "tierstore.testing", "tierstore.bench")


def test_the_library_never_imports_its_command_line():
    def rule(me: str, mod: str) -> bool:
        library = not _under(me, *TOOLS)
        return library and _under(mod, *TOOLS)

    assert _violations(rule) == []


def test_train_never_imports_interop():
    def rule(me: str, mod: str) -> bool:
        return _under(me, "tierstore.train") and _under(mod, "tierstore.interop")

    assert _violations(rule) == []


def test_backends_import_only_errors_and_keys():
    def rule(me: str, mod: str) -> bool:
        return _under(me, "backends") and not _under(mod, "backends", "tierstore.errors", "tierstore.keys") \
            and mod != "tierstore"

    assert _violations(rule) == []


def test_consistency_never_imports_the_store():
    def rule(me: str, mod: str) -> bool:
        return _under(me, "consistency") and _under(mod, "tierstore") and \
            not _under(mod, "tierstore.errors", "tierstore.keys") and mod != "tierstore"

    assert _violations(rule) == []


_INDEX_INTERNALS = re.compile(r"""["']ts:|\.index\._r\b|\bindex\._r\b|\._k\(|\._objname\(|\._keys\(""")


def test_only_consistency_knows_index_keys_and_client():
    bad = []
    for path in _modules():
        if _under(_name(path), "consistency"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _INDEX_INTERNALS.search(line.split("#")[0]):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert bad == []


def test_lazy_imports_say_why():
    bad = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for line, mod, in_func in _imports(path):
            if not in_func:
                continue
            here, before = lines[line - 1], lines[line - 2] if line > 1 else ""
            if "lazy:" not in here and "lazy:" not in before:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here.strip()}")
    assert sorted(set(bad)) == []


def test_the_agent_is_its_own_package():
    """The daemon lives in ``tierstore.agent``; ``tierstore/cli/agent.py`` is only its command line."""
    names = {_name(p) for p in _modules()}
    assert {"tierstore.agent", "tierstore.agent.server", "tierstore.agent.conn", "tierstore.agent.unasked"} <= names
    assert not names & {"tierstore.cli.agent_conn", "tierstore.cli.agent_unasked"}
    assert not any(_under(n, "tierstore.cli.bench") for n in names)  # the harness is tierstore.bench
    cli_agent = {mod for _line, mod, _f in _imports(ROOT / "tierstore" / "cli" / "agent.py") if _project(mod)}
    assert not any(_under(m, "backends", "consistency") for m in cli_agent), cli_agent  # no serving in the CLI


def _cycles(package: str) -> list[list[str]]:
    """The import circles among ``package``'s modules (strongly connected components of more than one
    module, or a module importing itself); an edge is an import naming the module itself."""
    mods = {_name(p): p for p in _modules() if _under(_name(p), package)}
    graph = {m: sorted({mod for _l, mod, _f in _imports(p) if mod in mods and mod != m}) for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return out


@pytest.mark.parametrize("package", ["tierstore.agent", "tierstore.cli", "tierstore.bench"])
def test_no_import_circle(package):
    assert _cycles(package) == []


@pytest.mark.parametrize("mod", ["tierstore", "tierstore.errors", "tierstore.keys"])
def test_public_names_keep_working(mod):
    import importlib

    m = importlib.import_module(mod)
    for name in getattr(m, "__all__", []):
        assert getattr(m, name) is not None, f"{mod}.{name}"
