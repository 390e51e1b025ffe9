"""The README's commands, run as written, from a package installed into a fresh virtual environment.

The environment is made with ``--system-site-packages`` (the dependencies are already here; the suite
must not need a network) and the README's install line runs in it with ``--no-deps --no-index
--no-build-isolation`` added, from a copy of the source. Every command then runs from a scratch
directory with no ``PYTHONPATH``: the installed ``tierstore`` console script and package, nothing of
the checkout. The commands and code come out of the README itself, so the README cannot drift from
what works.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
OFFLINE = ["--no-deps", "--no-index", "--no-build-isolation", "-q"]


def _section(heading: str) -> str:
    start = README.index(heading)
    nxt = re.search(r"^#{2,3} ", README[start + len(heading):], re.M)
    return README[start:start + len(heading) + nxt.start()] if nxt else README[start:]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


class Venv:
    def __init__(self, root: Path) -> None:
        self.root, self.bin = root, root / "venv" / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, cmd: str | list[str], cwd: Path, *, input: str | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
        args = shlex.split(cmd) if isinstance(cmd, str) else cmd
        if args[0] in ("tierstore", "python", "pip"):
            args = [str(self.bin / ("python" if args[0] == "pip" else args[0])),
                    *(["-m", "pip"] if args[0] == "pip" else []), *args[1:]]
        p = subprocess.run(args, cwd=cwd, env=self.env(), input=input, capture_output=True, text=True,
                           timeout=timeout, check=False)
        if check:
            assert p.returncode == 0, f"{cmd} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """A fresh venv with tierstore installed by the README's own install line (offline flags added)."""
    root = tmp_path_factory.mktemp("readme")
    src = root / "src"
    src.mkdir()
    for name in ("tierstore", "backends", "consistency"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    v = Venv(root)
    (line,) = [ln for b in _blocks(_section("## On a fresh machine"), "bash") for ln in b.splitlines()
               if ln.startswith("pip install")]
    install, _, _then = line.partition(" && ")
    v.run(shlex.split(install) + OFFLINE, cwd=src, timeout=600)
    return v


def _scratch(venv: Venv, name: str) -> Path:
    d = venv.root / name
    d.mkdir()
    return d


def test_the_install_line_gives_a_working_command_outside_the_checkout(venv):
    cwd = _scratch(venv, "anywhere")
    where = venv.run(["python", "-c", "import tierstore; print(tierstore.__file__)"], cwd).stdout.strip()
    assert where.startswith(str(venv.root)) and not where.startswith(str(REPO) + os.sep), where
    assert venv.run("tierstore --help", cwd).stdout.startswith("usage: tierstore COMMAND")
    assert "--steps" in venv.run("tierstore demo --help", cwd).stdout
    assert "--purge" in venv.run("tierstore server stop --help", cwd).stdout


def test_quick_start_then_state_commands_as_written(venv):
    cwd = _scratch(venv, "quickstart")
    (code,) = _blocks(_section("## Quick start"), "python")[:1]
    venv.run(["python", "-c", code], cwd)
    assert (cwd / ".tierstore" / "index").is_dir()
    lines = [ln.split("#")[0].strip() for b in _blocks(_section("### The embedded default"), "bash")
             for ln in b.splitlines() if ln.strip()]
    status = next(ln for ln in lines if " status" in ln)
    purge = next(ln for ln in lines if "--purge" in ln)
    out = venv.run(status, cwd).stdout
    assert out.startswith("running on unix://") and ".tierstore/durable" in out and "host tier" in out
    shm = Path(os.environ["TIERSTORE_SHM_DIR"])
    assert any(shm.iterdir())
    p = venv.run(purge, cwd, input="y\n")
    assert "remove it?" in p.stderr
    assert not (cwd / ".tierstore").exists() and list(shm.iterdir()) == []


_POPULATE = """
import torch, tierstore
store = tierstore.open()
epoch = store.open_epoch("gpt")
for step in (1, 2, 3):
    store.begin_step("gpt", step, 2, layout={"layers": ["a", "b"]}, epoch=epoch)
    for rank in (0, 1):
        objs = [store.put(tierstore.ShardKey("gpt", layer, step, rank), {"w": torch.full((128,), float(step))},
                          epoch=epoch) for layer in ("a", "b")]
        store.vote("gpt", step, rank, objs, epoch=epoch)
store.flush()
for step in (1, 2, 3):
    assert store.wait_step("gpt", step, timeout=30) == "durable"
store.close()
"""


def _shape(line: str) -> str:
    """A line with its figures (numbers, checksums, sizes) blanked, to compare its wording."""
    line = re.sub(r"\b[0-9a-f]{32}\b", "#", line)
    return re.sub(r"\d+(\.\d+)?( (B|KiB|MiB|GiB))?", "#", line).strip()


def test_admin_examples_as_written(venv):
    cwd = _scratch(venv, "admin")
    venv.run(["python", "-c", _POPULATE], cwd)
    (console,) = _blocks(_section("### `tierstore admin`"), "console")
    examples: list[tuple[str, list[str]]] = []
    for line in console.splitlines():
        if line.startswith("$ "):
            examples.append((line[2:], []))
        else:
            examples[-1][1].append(line)
    assert [cmd.split()[2] for cmd, _ in examples] == ["steps", "where", "verify", "gc"]
    try:
        for cmd, shown in examples:
            out = venv.run(cmd, cwd).stdout.splitlines()
            assert _shape(out[0]) == _shape(shown[0]), (cmd, out[0], shown[0])
            assert len(out) == len(shown), (cmd, out, shown)
    finally:
        venv.run("tierstore server stop --purge --yes --home .tierstore", cwd, check=False)


def test_the_readme_names_only_commands_and_extras_that_exist():
    from tierstore.cli import _COMMANDS
    from tierstore.cli.admin import build_parser as admin_parser
    from tierstore.cli.server import build_parser as server_parser

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r"tierstore\[([a-z,]+)\]", README))
    assert {e for group in named for e in group.split(",")} <= extras
    assert set(re.findall(r"`tierstore (\w+)", README)) <= set(_COMMANDS)

    def choices(parser) -> set[str]:
        return {c for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                for c in a.choices}

    admin = {m[1] for m in re.findall(r"tierstore admin((?: -\S+(?: [^\s-]\S*)?)*) ([a-z][a-z-]*)", README)}
    assert admin and admin <= choices(admin_parser())
    assert set(re.findall(r"tierstore server ([a-z]+)", README)) <= choices(server_parser())
    table = _section("### `tierstore admin`")
    assert set(re.findall(r"^\| `([a-z-]+)", table, re.M)) == choices(admin_parser())


@pytest.mark.slow
def test_the_demo_as_written(venv):
    """``tierstore demo`` with its defaults (about 30 s on 2 cores), then the two commands it prints."""
    cwd = _scratch(venv, "demo")
    (line,) = [ln for b in _blocks(_section("## On a fresh machine"), "bash") for ln in b.splitlines()
               if ln.startswith("pip install")]
    demo = line.partition(" && ")[2]
    t = time.monotonic()
    p = venv.run(demo, cwd, timeout=900)
    took = time.monotonic() - t
    assert "tierstore demo summary" in p.stdout and (cwd / "demo-out" / "demo.png").is_file(), took
    inspect = next(ln for ln in p.stdout.splitlines() if ln.startswith("inspect it: ")).removeprefix("inspect it: ")
    assert "durable" in venv.run(inspect, cwd).stdout
    purge = p.stdout.rsplit("remove it all with: ", 1)[1].strip()
    venv.run(purge, cwd, input="y\n")
    assert not (cwd / ".tierstore").exists()
