"""Every collected test checks something: found by reading tests/*.py (ast), not by running them.

The rule, kept simple on purpose. A *test* is what pytest collects by its default names: a function
``test*`` at the top of a ``tests/test_*.py`` file, or a method ``test*`` of a class (in any tests/ module:
the conformance suites are collected through their subclasses). A function *checks* when its body
(nested functions and lambdas included) has any of:

- an ``assert`` statement, or a ``raise``;
- a call of ``pytest.raises``, ``pytest.warns``, ``pytest.deprecated_call`` or ``pytest.fail``, or of
  anything whose name starts with ``assert`` (``torch.testing.assert_close``, ``self.assertEqual``);
- an ``except`` naming an exception type other than ``Exception``/``BaseException`` (the test lets that
  one through and fails on any other: a fuzz test's "typed errors only");
- a call of a function defined in tests/ that checks (by this same rule, so helpers of helpers count): by
  its name (``save_and_check(...)``), through a tests/ module (``_leaks.clean(...)``), or as a method
  (``machine.states_match_the_model()``); a method of a module that is not from tests/
  (``subprocess.run``) never counts as a helper, whatever its name.

A test that checks nothing is named here (file, line, name) and fails this test. ``ALLOWED`` lists the tests
that check by other means, each with why; it is empty, and should stay so.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
EXPECTS = {"raises", "warns", "deprecated_call", "fail"}  # pytest.X(...) that checks
ALLOWED: dict[str, str] = {}  # "tests/test_x.py::test_y" -> why it checks without any of the above


@dataclass
class _Module:
    path: Path
    tree: ast.Module
    test_aliases: set[str] = field(default_factory=set)  # names bound to tests/ modules (from tests import _leaks)
    other_aliases: set[str] = field(default_factory=set)  # names bound to other modules (import subprocess)


def _modules() -> list[_Module]:
    out = []
    for path in sorted(TESTS.glob("*.py")):
        m = _Module(path, ast.parse(path.read_text(), filename=str(path)))
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    (m.test_aliases if a.name.startswith("tests.") and a.asname else m.other_aliases).add(name)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                from_tests = node.module == "tests" or node.module.startswith("tests.")
                for a in node.names:
                    if from_tests and (node.module == "tests" or (TESTS / f"{a.name}.py").is_file()):
                        m.test_aliases.add(a.asname or a.name)
                    elif not from_tests:
                        m.other_aliases.add(a.asname or a.name)
        out.append(m)
    return out


Func = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.Module) -> tuple[list[Func], list[Func]]:
    """The module's top-level functions, and the methods of its classes (nested classes too)."""
    top = [n for n in tree.body if isinstance(n, Func)]
    methods = [f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body if isinstance(f, Func)]
    return top, methods


def _call_name(call: ast.Call) -> tuple[str | None, str | None]:
    """``(receiver, name)`` of a call: ``f(...)`` -> ``(None, "f")``, ``a.f(...)`` -> ``("a", "f")``, ``x().f()``
    -> ``("", "f")``."""
    fn = call.func
    if isinstance(fn, ast.Name):
        return None, fn.id
    if isinstance(fn, ast.Attribute):
        return (fn.value.id if isinstance(fn.value, ast.Name) else ""), fn.attr
    return None, None


def _checks_directly(fn: Func) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert | ast.Raise):
            return True
        if isinstance(node, ast.ExceptHandler) and node.type is not None and not (
                isinstance(node.type, ast.Name) and node.type.id in ("Exception", "BaseException")):
            return True
        if isinstance(node, ast.Call):
            receiver, name = _call_name(node)
            if name and (name.startswith("assert") or (receiver == "pytest" and name in EXPECTS)):
                return True
    return False


def _calls(fn: Func, mod: _Module) -> tuple[set[str], set[str]]:
    """Names ``fn`` calls as plain functions (or through a tests/ module), and as methods of an object."""
    plain, methods = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            receiver, name = _call_name(node)
            if name is None:
                continue
            if receiver is None or receiver in mod.test_aliases:
                plain.add(name)
            elif receiver not in mod.other_aliases:
                methods.add(name)
    return plain, methods


def checking_helpers(mods: list[_Module]) -> tuple[set[str], set[str]]:
    """The names of the functions and of the methods defined in tests/ that check (to a fixed point)."""
    funcs: list[tuple[Func, _Module, bool]] = []
    for m in mods:
        top, methods = _functions(m.tree)
        funcs += [(f, m, False) for f in top] + [(f, m, True) for f in methods]
    plain_ok: set[str] = set()
    method_ok: set[str] = set()
    calls = {id(f): _calls(f, m) for f, m, _ in funcs}
    changed = True
    while changed:
        changed = False
        for f, _m, is_method in funcs:
            ok = method_ok if is_method else plain_ok
            if f.name in ok:
                continue
            plain, meth = calls[id(f)]
            if _checks_directly(f) or plain & plain_ok or meth & (method_ok | plain_ok):
                ok.add(f.name)
                changed = True
    return plain_ok, method_ok


def unchecked_tests() -> list[str]:
    """``path:line: name`` of each collected test that checks nothing (see the module docstring)."""
    mods = _modules()
    plain_ok, method_ok = checking_helpers(mods)
    found = []
    for m in mods:
        top, methods = _functions(m.tree)
        tests = [f for f in methods if f.name.startswith("test")]
        if m.path.name.startswith("test_"):
            tests += [f for f in top if f.name.startswith("test")]
        for f in tests:
            rel = m.path.relative_to(TESTS.parent)
            if f"{rel}::{f.name}" in ALLOWED:
                continue
            plain, meth = _calls(f, m)
            if not (_checks_directly(f) or plain & plain_ok or meth & (method_ok | plain_ok)):
                found.append(f"{rel}:{f.lineno}: {f.name}")
    return found


def test_every_collected_test_checks_something():
    found = unchecked_tests()
    assert not found, ("these tests neither assert, nor expect an exception, nor call a tests/ helper that does "
                       "(the rule: tests/test_honest.py's docstring):\n  " + "\n  ".join(found))


def test_the_rule_finds_a_test_that_only_prints_and_passes_one_that_calls_a_checking_helper(tmp_path, monkeypatch):
    """The check itself, on a made-up tests/ directory: it names what checks nothing, and only that."""
    (tmp_path / "test_made_up.py").write_text(
        "import subprocess\nimport pytest\nfrom tests import _helpers\n\n"
        "def helper(x):\n    assert x\n\n"
        "def indirect(x):\n    helper(x)\n\n"
        "def test_prints(capsys):\n    print('counts')\n\n"
        "def test_runs_a_command_only():\n    subprocess.run(['true'])\n\n"
        "def test_calls_a_helper():\n    indirect(1)\n\n"
        "def test_through_a_module():\n    _helpers.check(2)\n\n"
        "def test_expects():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
        "def test_typed_errors_only(x):\n    try:\n        int(x)\n    except ValueError:\n        pass\n\n"
        "def test_swallows_everything(x):\n    try:\n        int(x)\n    except Exception:\n        pass\n\n"
        "class TestThing:\n    def test_method_only_computes(self):\n        sum([1])\n\n"
        "    def test_method_asserts(self):\n        self.assertEqual(1, 1)\n")
    (tmp_path / "_helpers.py").write_text("def check(x):\n    if not x:\n        raise AssertionError(x)\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["TESTS"]), "TESTS", tmp_path)
    got = [line.rsplit(": ", 1)[1] for line in unchecked_tests()]
    assert got == ["test_method_only_computes", "test_prints", "test_runs_a_command_only",
                   "test_swallows_everything"], got
