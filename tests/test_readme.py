"""The README's commands, run as written, in a virtual environment made the way a user makes one.

``python3 -m venv`` (no ``--system-site-packages``: nothing of the interpreter running the tests is visible)
and then the README's install line as written, with pip's defaults (build isolation: pip fetches the build
backend named in pyproject.toml, as on a fresh machine), from a copy of the source. The packages come from
the machine's package index as configured (pip's cache and local wheels, such as the CPU torch wheel, make
it affordable: ``INSTALL_S`` below is measured). Every command then runs from a scratch directory with no
``PYTHONPATH``: the installed ``tierstore`` console script and package, nothing of the checkout. The
commands and code come out of the README (and, for the admin examples, ``docs/operating/admin.md``)
themselves, so the text cannot drift from what works. ``tests/test_docs.py`` runs every Python block, also
pasted into the REPL, and checks every other command line of the docs against its parser.
"""

from __future__ import annotations

import ast
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

# the fixture installs torch and the dependencies into a fresh venv: minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(1800)

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
ADMIN_PAGE = (REPO / "docs" / "operating" / "admin.md").read_text()
DEMO_PAGE = (REPO / "docs" / "operating" / "demo.md").read_text()


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = re.search(r"^#{1,3} ", text[start + len(heading):], re.M)
    return text[start:start + len(heading) + nxt.start()] if nxt else text[start:]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands(text: str) -> list[str]:
    """The command lines of ``text``'s bash blocks, comments removed."""
    return [ln.split(" #")[0].strip() for b in _blocks(text, "bash") for ln in b.splitlines()
            if ln.strip() and not ln.startswith("#")]


INSTALL_LINE = next(ln for ln in _commands(_section(README, "## On a fresh machine")) if ln.startswith("pip install"))


class Venv:
    def __init__(self, root: Path) -> None:
        self.root, self.bin = root, root / "venv" / "bin"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.root / "venv")  # as `. venv/bin/activate` sets it
        # pip's own setting, not the install line: no bytecode compiled at install time (torch alone is thousands
        # of modules, a large part of the install's CPU on 2 cores); Python compiles what it imports, as it runs
        env["PIP_NO_COMPILE"] = "1"
        return env

    def run(self, cmd: str | list[str], cwd: Path, *, input: str | None = None, timeout: float = 300,
            check: bool = True, shell: bool = False) -> subprocess.CompletedProcess:
        args = cmd if shell else (shlex.split(cmd) if isinstance(cmd, str) else cmd)
        p = subprocess.run(args, cwd=cwd, env=self.env(), input=input, capture_output=True, text=True,
                           timeout=timeout, check=False, shell=shell)
        if check:
            assert p.returncode == 0, f"{cmd} -> {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
        return p


def _source_copy(dest: Path, *, with_tests: bool = False) -> Path:
    dest.mkdir()
    names = ["tierstore", "backends", "consistency", *(["tests", "scripts", "bench", "docker"] if with_tests else [])]
    for name in names:
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "mkdocs.yml"):
        shutil.copy(REPO / name, dest / name)
    if with_tests:
        shutil.copytree(REPO / "docs", dest / "docs")
    return dest


def make_venv(root: Path) -> Venv:
    """``python3 -m venv venv``, as a user types it: the interpreter's own site-packages stay out."""
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    v = Venv(root)
    cfg = (root / "venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg, cfg
    return v


INSTALL_S: dict[str, float] = {}  # what the install took in this session (the report of the fixture)


_BUILT: list[Venv] = []  # this session's venv: built once even when the module's fixtures are set up again


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """A fresh venv with tierstore installed by the README's own install line, as written.

    Built once per pytest session (each xdist worker is one): a worker whose queue ran dry between two tests
    of this file tears the module's fixtures down and sets them up again, and each build is minutes of pip."""
    if _BUILT:
        return _BUILT[0]
    root = tmp_path_factory.mktemp("readme")
    src = _source_copy(root / "src")
    t = time.monotonic()
    v = make_venv(root)
    install = INSTALL_LINE.partition(" && ")[0]
    v.run(install, cwd=src, timeout=1200, shell=True)  # shell: the quoting is the README's
    INSTALL_S["venv + install"] = time.monotonic() - t
    print(f"\nthe README's install into a fresh venv took {INSTALL_S['venv + install']:.0f} s", file=sys.stderr)
    site = v.run(["python", "-c", "import sys; print(sys.path)"], cwd=root).stdout
    assert not any(p.startswith(str(REPO)) for p in ast.literal_eval(site)), site
    _BUILT.append(v)
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
    # what the README says the base install brings: safetensors (checking an export), and torch's CPU build
    out = venv.run(["python", "-c", "import safetensors, matplotlib, torch; print(torch.__version__)"], cwd).stdout
    assert out.strip().startswith("2.13.0"), out


def test_quick_start_then_state_commands_as_written(venv):
    cwd = _scratch(venv, "quickstart")
    quick = _section(README, "## Quick start")
    (code,) = _blocks(quick, "python")
    p = venv.run(["python", "-c", code], cwd)
    assert "not stored:" in p.stdout
    assert (cwd / ".tierstore" / "index").is_dir()
    lines = _commands(quick)
    status = next(ln for ln in lines if " status" in ln)
    purge = next(ln for ln in lines if "--purge" in ln)
    out = venv.run(status, cwd).stdout
    assert out.startswith("running on unix://") and ".tierstore/durable" in out and "host tier" in out
    shm = Path(os.environ["TIERSTORE_SHM_DIR"])
    assert any(shm.iterdir())
    p = venv.run(purge, cwd, input="y\n")
    assert "remove it?" in p.stderr and "stopped the index server" in p.stdout
    assert not (cwd / ".tierstore").exists() and list(shm.iterdir()) == []


def test_the_training_loop_as_written_resumes(venv):
    cwd = _scratch(venv, "loop")
    (code,) = _blocks(_section(README, "## A training loop"), "python")
    assert venv.run(["python", "-c", code], cwd).stdout.splitlines()[0] == "fresh start"
    again = venv.run(["python", "-c", code], cwd).stdout  # "Run it again and it resumes": the block says so itself
    assert again.splitlines()[0] == "resumed from step 9", again
    venv.run("tierstore server stop --purge --yes --home .tierstore", cwd)


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
    store.flush()  # durable before the next step commits (a lagging migration skips the steps between)
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
    (console,) = _blocks(ADMIN_PAGE, "console")
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
        # the page's promise: --json composes with shell tools (one record per line, `| head -1` a whole one)
        p = venv.run("tierstore admin --json steps gpt | head -1", cwd, shell=True)
        assert p.stdout.startswith('{"') and p.stdout.count("\n") == 1 and '"step":1' in p.stdout, p.stdout
        p = venv.run("tierstore server list --json", cwd)
        assert str(cwd / ".tierstore") in p.stdout and p.stdout.startswith('{"')
    finally:
        venv.run("tierstore server stop --purge --yes --home .tierstore", cwd, check=False)


def test_the_readme_names_only_commands_and_extras_that_exist():
    from tierstore.cli import _COMMANDS
    from tierstore.cli.admin import build_parser as admin_parser
    from tierstore.cli.server import build_parser as server_parser

    docs = README + "".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r"tierstore\[([a-z,]+)\]", docs)) | set(re.findall(r"`\[([a-z,]+)\]`", docs))
    assert {e for group in named for e in group.split(",")} <= extras
    assert set(re.findall(r"`tierstore (\w+)", docs)) <= set(_COMMANDS)

    def choices(parser) -> set[str]:
        return {c for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                for c in a.choices}

    flags = r" --json| --yes"  # options without a value; the others take one
    admin = {m[1] for m in re.findall(rf"tierstore admin((?:{flags}| -\S+(?: [^\s-]\S*)?)*) ([a-z][a-z-]*)", docs)}
    assert admin and admin <= choices(admin_parser())
    assert set(re.findall(r"tierstore server ([a-z]+)", docs)) <= choices(server_parser())
    assert set(re.findall(r"^\| `([a-z-]+)", ADMIN_PAGE, re.M)) == choices(admin_parser())
    for md in re.findall(r"\]\((docs/[^)#]+)", README):  # the README's links to the docs resolve
        assert (REPO / md).is_file(), md
    assert len(README.splitlines()) <= 250


def test_the_readme_counts_of_the_test_suite_are_true():
    """The README's "N of M tests" is what ``--collect-only`` counts (it changes as tests are added: keep it true)."""
    m = re.search(r"`--fast` leaves out ([\d,]+) of the ([\d,]+) tests", README)
    assert m, "the README states the counts of --fast"
    slow, total = (int(x.replace(",", "")) for x in m.groups())
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", "slow"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    counts = re.search(r"(\d+)/(\d+) tests collected", p.stdout)
    assert counts, p.stdout[-2000:]
    assert (int(counts[1]), int(counts[2])) == (slow, total), counts.group(0)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TIERSTORE_TEST_FRESH_SUITE") != "1",
                    reason="opt-in (TIERSTORE_TEST_FRESH_SUITE=1): it installs every test extra into a new venv, "
                           "6 to 13 minutes on 2 cores, and CI runs scripts/test itself on a fresh machine")
def test_scripts_test_runs_in_a_fresh_venv(tmp_path):
    """``scripts/test`` as a newcomer runs it, in a fresh venv of their own: it installs the test extras (build
    isolation, no system site-packages), runs ruff and mypy, then pytest; here on one small file, since the whole
    suite is what is running this test (CI runs ``scripts/test`` itself)."""
    src = _source_copy(tmp_path / "src", with_tests=True)
    v = make_venv(tmp_path)
    p = v.run("scripts/test --fast tests/test_keys.py -q", cwd=src, timeout=1800,
              check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert re.search(r"\d+ passed", p.stdout), p.stdout[-2000:]


@pytest.mark.slow
def test_the_demo_as_written(venv):
    """``tierstore demo`` with its defaults (about 30 s on 2 quiet cores), then the two commands it prints; its
    summary has the rows the docs show."""
    cwd = _scratch(venv, "demo")
    demo = INSTALL_LINE.partition(" && ")[2]
    t = time.monotonic()
    p = venv.run(demo, cwd, timeout=900)
    took = time.monotonic() - t
    assert "tierstore demo summary" in p.stdout and (cwd / "demo-out" / "demo.png").is_file(), took
    # the README's picture is what the demo draws today, in kind (the same series and titles, other numbers):
    # regenerate it with `tierstore demo` and copy demo-out/demo.png to docs/demo.png when this fails
    from tierstore.cli.demo_plot import drawn

    assert drawn(REPO / "docs" / "demo.png") == drawn(cwd / "demo-out" / "demo.png") != {}
    (shown,) = _blocks(DEMO_PAGE, "console")
    rows = [ln.split("│")[1].strip() for ln in shown.splitlines() if ln.startswith("│")]
    for row in rows:
        label = re.sub(r"\d+", "#", row)
        assert any(re.sub(r"\d+", "#", ln) .find(label) >= 0 for ln in p.stdout.splitlines()), row
    inspect = next(ln for ln in p.stdout.splitlines() if ln.startswith("inspect it: ")).removeprefix("inspect it: ")
    assert "durable" in venv.run(inspect, cwd).stdout
    purge = p.stdout.rsplit("remove it all with: ", 1)[1].strip()
    venv.run(purge, cwd, input="y\n")
    assert not (cwd / ".tierstore").exists()


def test_the_first_screen_example_as_written_saves_then_resumes(venv):
    """The README's first example ("In a minute"), installed by its own line: a save on a fresh job, then, run
    again, a restore of that step and a save of the next."""
    cwd = _scratch(venv, "minute")
    minute = _section(README, "## In a minute")
    (code,) = _blocks(minute, "python")
    (install,) = [ln for ln in _commands(minute) if ln.startswith("pip install")]
    assert install == INSTALL_LINE.partition(" && ")[0].replace(" '.[plot]'", " .")  # the fixture's, less [plot]
    assert venv.run(["python", "-c", code], cwd).stdout.strip() == "committed"
    again = code.replace("print(ckpt.wait())", "print(step, ckpt.wait())")
    assert again != code
    assert venv.run(["python", "-c", again], cwd).stdout.strip() == "0 committed"  # it restored step 0, saved 1
    venv.run("tierstore server stop --purge --yes --home .tierstore", cwd)


def test_the_docs_picture_the_transcript_and_the_benchmarks_page_are_one_run():
    """docs/demo.png records the figures it drew (tierstore.cli.demo_plot.numbers): the demo page's transcript is
    the summary of that same run, and the benchmarks page quotes the same figures. Redraw the three together."""
    pytest.importorskip("PIL", reason="Pillow is not installed (matplotlib's dependency, tierstore[plot])")
    from tierstore.cli.demo_plot import numbers

    shown = numbers(REPO / "docs" / "demo.png")
    assert shown, "docs/demo.png records no figures: redraw it with `tierstore demo`"
    (transcript,) = _blocks(DEMO_PAGE, "console")
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in transcript.splitlines() if ln.startswith("│")}
    assert rows["stall per save (median, max)"] == f"{shown['stall_median']}, {shown['stall_max']}"
    assert rows["torch.save of the same state (median, max)"].startswith(
        f"{shown['torch_save_median']}, {shown['torch_save_max']} (")
    assert f" in {shown['restore']}: " in rows["restore (2 ranks)"]
    assert rows["torch.load + load_state_dict of that file (slowest rank, median)"] == shown["torch_load"]
    assert rows[f"written vs full checkpoints (steps {shown['steps']}, 2 ranks)"] == (
        f"{shown['written']} vs {shown['full']} ({shown['smaller']} smaller; refs {shown['refs']})")
    bench = _section((REPO / "docs" / "benchmarks.md").read_text(), "## The demo against torch.save")
    for key in ("stall_median", "stall_max", "torch_save_median", "torch_save_max", "restore", "torch_load",
                "written", "full", "refs"):
        assert shown[key] in bench, key
