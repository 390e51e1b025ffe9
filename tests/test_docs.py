"""The documentation: the site builds in strict mode, and every snippet of the README and of docs/ works as written.

- ``scripts/docs`` builds the MkDocs site; a broken link, a missing anchor and a missing API reference each
  fail the build (checked on a copy of the pages with one of each added).
- Every ``python`` block runs twice, each in a fresh directory with no state: as a script, and pasted line by
  line into the interactive interpreter (``code.InteractiveConsole``, what ``python`` at a terminal runs), so a
  block that only works as a file (a dedented line right after an indented block) fails here as it would for a
  reader. A block that needs objects of the reader's own program (a model, an optimizer, a data loader) says
  which with a comment on the line before it, ``<!-- test: trainer -->``, invisible in the rendered page; the
  contexts below define those names first, and nothing else. Server addresses in a block are replaced by the
  test servers' (``SUBSTITUTE``).
- A ``bash`` block with such a comment runs too, with ``tierstore`` the console script as pip installs it. Every
  other ``bash`` line is checked as written: each ``tierstore ...`` command parses with the command's own
  parser, each ``python -m MODULE`` names a module that exists, each script and file it names exists, each
  extra it installs is in pyproject.toml. (``tests/test_readme.py`` runs the README's commands in a fresh venv.)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import _warm

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MARK = re.compile(r"<!-- test: ([a-z ]+) -->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    contexts: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    """Every fenced block of the pages, with the contexts its marker comment names."""
    out = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.fullmatch(lines[i - 1].strip()) if i else None
            out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             tuple(mark.group(1).split()) if mark else ()))
            i = end + 1
    return out


# -- contexts: what a block assumes the reader's program already has -----------------------------------------
CONTEXTS = {
    "trainer": '''
import torch, tierstore
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)

class Loader:  # a data loader with its position as state, as torchdata's StatefulDataLoader has
    def __init__(self):
        self.pos = 0
    def state_dict(self):
        return {"pos": self.pos}
    def load_state_dict(self, sd):
        self.pos = sd["pos"]

loader = Loader()
steps = 4

def train_step():
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    loader.pos += 4
''',
    "store": '''
import tierstore
store = tierstore.open()
''',
    "dcp": '''
import socket, torch, torch.distributed as dist
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    _port = _s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)

class Position:  # a Stateful: a data loader's position, the train state
    def __init__(self):
        self.pos = 7
    def state_dict(self):
        return {"pos": self.pos}
    def load_state_dict(self, sd):
        self.pos = sd["pos"]

dataloader, train_state = Position(), Position()
''',
    "weights": '''
import torch, tierstore
from pathlib import Path
from tierstore.train.checkpointer import Checkpointer
from tierstore.train.policies import differential
Path("mymodels.py").write_text(
    "from tierstore.testing.gpt import GPT, GPTConfig\\n\\n\\n"
    "def build_gpt():\\n    return GPT(GPTConfig(vocab=32, d_model=16, n_layer=2, n_head=2, block=8))\\n")
import mymodels
torch.manual_seed(0)
model = mymodels.build_gpt()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
store = tierstore.open()
_ck = Checkpointer(store, "gpt", state={"model": model, "optim": opt, "sched": sched})
for _step in range(3):
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    opt.zero_grad()
    _ck.save(_step)

assert _ck.wait() == "committed"
_ck.close()
''',
    "lightning": '''
import lightning.pytorch as L
import torch
from tierstore.interop.lightning import TierStoreCheckpoint
torch.manual_seed(0)

class Net(L.LightningModule):  # the LightningModule of docs/integrations/lightning.md
    def __init__(self, lr: float = 0.02):
        super().__init__()
        self.save_hyperparameters()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)),
                                   batch_size=8)
_trainer = L.Trainer(max_steps=8, callbacks=[TierStoreCheckpoint(dirpath="ckpts", every_n_train_steps=4,
                     save_last=True)], accelerator="cpu", logger=False, enable_progress_bar=False)
_trainer.fit(Net(), data)  # the run that left ckpts/last.ckpt
''',
    "hf": '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from tierstore.interop.huggingface import TierStoreTrainer
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 64, (24, 16))
train = [{"input_ids": r, "labels": r} for r in ids]
_args = dict(output_dir="out", save_steps=4, save_total_limit=2, per_device_train_batch_size=4, report_to=[],
             use_cpu=True, disable_tqdm=True)
TierStoreTrainer(model=model, args=TrainingArguments(max_steps=8, **_args), train_dataset=train).train()
args = TrainingArguments(max_steps=12, **_args)  # the run of 12 steps that was interrupted after out/checkpoint-8
''',
}
# run after the block, in the same program (what the context opened, closed)
TEARDOWN = {"store": "store.close()\n", "weights": "store.close()\n",
            "dcp": "store.close()\ndist.destroy_process_group()\n"}
# the block's example addresses -> the test servers' (filled in by the fixture)
SUBSTITUTE = {"services": {"rediss://:password@redis.internal:6380/0": "{redis_url}"}}

REPL = r'''
import code, os, runpy, sys, traceback
script_dir, repl_dir = sys.argv[1:3]
if script_dir != "-":  # first as a script: the context, the block and the teardown in one file, run as __main__
    os.chdir(script_dir)
    sys.path.insert(0, script_dir)
    runpy.run_path("snippet.py", run_name="__main__")
    sys.path.remove(script_dir)
    print("== ran as a script", flush=True)
os.chdir(repl_dir)  # then pasted into the REPL, in a directory of its own
sys.path.insert(0, "")
setup, snippet, teardown = (open(p).read() for p in ("_setup.py", "_snippet.py", "_teardown.py"))
ns = {"__name__": "__console__"}
exec(compile(setup, "<context>", "exec"), ns)
errors = []

class Console(code.InteractiveConsole):
    def showsyntaxerror(self, filename=None, **kw):
        errors.append(traceback.format_exc())
        super().showsyntaxerror(filename)

    def showtraceback(self):
        errors.append(traceback.format_exc())
        super().showtraceback()

console = Console(ns)
more = False
for line in snippet.splitlines():  # as pasted: one line at a time, a blank line ends a compound statement
    more = console.push(line)
if more:
    console.push("")
exec(compile(teardown, "<teardown>", "exec"), ns)
print("== pasted into the REPL:", "failed" if errors else "ok", flush=True)
sys.exit(1 if errors else 0)
'''

def _distinct(bs: list[Block]) -> list[Block]:
    """One of each: a block written twice (the README's quick start is also the docs') is run once."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out = []
    for b in bs:
        if (b.text, b.contexts) not in seen:
            seen.add((b.text, b.contexts))
            out.append(b)
    return out


PYTHON_BLOCKS = _distinct([b for b in blocks() if b.lang == "python"])
RUN_BASH = [b for b in blocks() if b.lang == "bash" and b.contexts]


@pytest.fixture
def services(redis_url, s3_env, monkeypatch):
    """The environment of the ``services`` context: the test's Redis, and S3 (moto) with the bucket its block names."""
    from tests.s3_server import _admin_client

    _admin_client(s3_env).create_bucket(Bucket="my-bucket")
    monkeypatch.setenv("TIERSTORE_S3_ENDPOINT", s3_env)
    return {"redis_url": redis_url}


def _prepare(block: Block, request) -> tuple[str, str, str]:
    setup = "".join(CONTEXTS.get(c, "") for c in block.contexts)
    teardown = "".join(TEARDOWN.get(c, "") for c in block.contexts)
    if "dcp" in block.contexts:
        teardown = TEARDOWN["dcp"]
    text = block.text
    for c in block.contexts:
        if c in SUBSTITUTE:
            values = request.getfixturevalue(c)
            for old, new in SUBSTITUTE[c].items():
                text = text.replace(old, new.format(**values))
    unknown = set(block.contexts) - set(CONTEXTS) - set(SUBSTITUTE)
    assert not unknown, f"{block.id}: no test context {sorted(unknown)}"
    return setup, text, teardown


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs_as_a_script_and_pasted_into_the_repl(block, tmp_path, request):
    """One interpreter (forked warm, torch imported: tests/_warm.py): the block as a script (``runpy``, as ``__main__``) in one fresh
    directory, then pasted into ``code.InteractiveConsole`` in another."""
    setup, text, teardown = _prepare(block, request)
    script, repl = tmp_path / "script", tmp_path / "repl"
    script.mkdir()
    repl.mkdir()
    (script / "snippet.py").write_text(setup + "\n" + text + "\n" + teardown)
    for name, content in (("_setup.py", setup), ("_snippet.py", text), ("_teardown.py", teardown)):
        (repl / name).write_text(content)
    # TMPDIR under the test's own directory: a home a snippet makes with tempfile.mkdtemp() is there, so its
    # index server (which outlives the store, by design) is stopped after the test like every other
    env = {**_env(), "TMPDIR": str(tmp_path)}
    preload = _warm.LIGHTNING if "lightning" in text else _warm.HF if "transformers" in text else _warm.TORCH
    p = _warm.run([sys.executable, "-c", REPL, str(script), str(repl)], env=env, timeout=300, preload=preload)
    mode = "pasted into the REPL" if "== ran as a script" in p.stdout else "as a script"
    assert p.returncode == 0, f"{block.id} {mode}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


def _console_script(bindir: Path) -> None:
    """A ``tierstore`` on PATH as pip's console script is: no current directory on sys.path (``python -P``); and
    ``python``, the suite's interpreter."""
    bindir.mkdir()
    shim = bindir / "tierstore"  # both forked from the warm interpreter (tests/_warm.py: torch imported once)
    shim.write_text("#!/bin/sh\n" + _warm.shim(["-P", "-c", "import sys; from tierstore.cli import main; sys.exit(main())"])
                    + "\n")
    shim.chmod(0o755)
    py = bindir / "python"  # a block's `python` is the interpreter the suite runs on, as in an activated venv
    py.write_text("#!/bin/sh\n" + _warm.shim() + "\n")
    py.chmod(0o755)


@pytest.mark.parametrize("block", RUN_BASH, ids=lambda b: b.id)
def test_bash_block_runs_as_written(block, tmp_path, request):
    setup, text, teardown = _prepare(block, request)
    _console_script(tmp_path / "bin")
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {**_env(), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    (cwd / "_setup.py").write_text(setup + "\n" + teardown)
    p = _warm.run([sys.executable, "_setup.py"], cwd=cwd, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, f"{block.id}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


# -- every other command line, checked as written ----------------------------------------------------------------
def _parsers() -> dict[str, object]:
    from tierstore.cli.admin import build_parser as admin
    from tierstore.cli.agent import build_parser as agent
    from tierstore.bench.run import build_parser as bench
    from tierstore.cli.demo import build_parser as demo
    from tierstore.cli.server import build_parser as server

    return {"admin": admin, "server": server, "demo": demo, "bench": bench, "agent": agent}


def _check_command(words: list[str], extras: set[str]) -> str | None:
    """Why the command line ``words`` would fail as written, or None."""
    if words[0] == "tierstore":
        from tierstore.cli import _COMMANDS

        if len(words) == 1 or words[1] not in _COMMANDS:
            return f"no tierstore command {words[1:2]}"
        parser = _parsers().get(words[1])
        if parser is not None:
            try:
                parser().parse_args(words[2:])  # type: ignore[operator]
            except SystemExit:
                return "its parser refuses it"
        return None
    if words[:2] == ["python", "-m"] or words[:2] == ["python3", "-m"]:
        import importlib.util

        if words[2] == "venv":
            return None
        return None if importlib.util.find_spec(words[2]) is not None else f"no module {words[2]}"
    if words[0] == "python" and words[1].endswith(".py"):
        return None if (REPO / words[1]).is_file() else f"no file {words[1]}"
    if words[0] in ("pip", "python3") or words[:2] == ["python", "-m"]:
        return None
    if words[0].startswith(("scripts/", "bench/")):
        return None if (REPO / words[0]).is_file() else f"no script {words[0]}"
    if words[0] == "docker-compose":
        return None if (REPO / words[words.index("-f") + 1]).is_file() else "no compose file"
    if words[0] in (".", "source"):
        return None
    return f"a command this test does not know how to check: {words[0]}"


def _command_lines(text: str) -> list[list[str]]:
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():  # a line continued with a backslash, joined
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r" && | \| ", line):
            out.append(shlex.split(part))
    return out


def test_every_other_command_line_is_checked_as_written():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    bad = []
    for b in blocks():
        if b.lang != "bash" or b.contexts:
            continue
        for words in _command_lines(b.text):
            if words[0] == "pip":
                named = {e for group in re.findall(r"\[([a-z,]+)\]", " ".join(words)) for e in group.split(",")}
                if not named <= extras:
                    bad.append(f"{b.id}: {' '.join(words)}: no extra {sorted(named - extras)}")
                continue
            why = _check_command(words, extras)
            if why:
                bad.append(f"{b.id}: {' '.join(words)}: {why}")
    assert bad == []


def test_every_block_is_a_kind_this_file_tests():
    """A new kind of block (or a console transcript nobody compares) must come with its test."""
    kinds = {(b.lang, bool(b.contexts)) for b in blocks()}
    assert kinds <= {("python", False), ("python", True), ("bash", False), ("bash", True), ("console", False), ("", False)}
    transcripts = {b.id.split(":")[0] for b in blocks() if b.lang == "console"}
    assert transcripts <= {"docs/operating/admin.md", "docs/operating/demo.md"}  # compared in tests/test_readme.py
    diagrams = [b for b in blocks() if b.lang == ""]
    diagram_pages = ("docs/concepts.md", "README.md", "docs/index.md")  # the architecture diagram, one text in three
    assert all(b.id.startswith(diagram_pages) for b in diagrams), [b.id for b in diagrams]


# -- the site ------------------------------------------------------------------------------------------------
def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "docs"), "-f", str(config), "--site-dir", str(site)], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300,
                          check=False)


def test_the_site_builds_strict(tmp_path):
    p = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WARNING" not in p.stderr, p.stderr
    site = tmp_path / "site"
    for page in ("index.html", "guarantees/index.html", "concepts/index.html", "reference/train/index.html",
                 "integrations/dcp/index.html", "operating/admin/index.html", "demo.png"):
        assert (site / page).is_file(), page
    api = (site / "reference" / "train" / "index.html").read_text()
    assert 'id="tierstore.train.checkpointer.Checkpointer.save"' in api  # the reference came from the docstrings
    nav = (site / "index.html").read_text()
    for md in (REPO / "docs").rglob("*.md"):  # every page is in the nav (none left unreachable)
        rel = md.relative_to(REPO / "docs").with_suffix("")
        href = "" if rel.name == "index" and rel.parent == Path(".") else (
            f"{rel.parent}/" if rel.name == "index" else f"{rel}/")
        assert f'href="{href}"' in nav or f'href="./{href}"' in nav or href == "", (md, href)


@pytest.mark.parametrize("breakage", ["a link to a page that does not exist", "an anchor that does not exist",
                                      "a reference to a module that does not exist"])
def test_a_broken_page_fails_the_build(tmp_path, breakage):
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    text = {"a link to a page that does not exist": "[see](no-such-page.md)",
            "an anchor that does not exist": "[see](concepts.md#no-such-section)",
            "a reference to a module that does not exist": "::: tierstore.no_such_module"}[breakage]
    (docs / "wire-format.md").write_text((docs / "wire-format.md").read_text() + "\n" + text + "\n")
    config = (REPO / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}").replace(
        "paths: [.]", f"paths: [{REPO}]").replace("- scripts/mkdocs_hooks.py", f"- {REPO}/scripts/mkdocs_hooks.py")
    assert str(docs) in config and f"{REPO}/scripts/mkdocs_hooks.py" in config  # paths resolve from the config's dir
    (tmp_path / "mkdocs.yml").write_text(config)
    p = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert p.returncode != 0, p.stderr
    assert {"a link to a page that does not exist": "no-such-page.md", "an anchor that does not exist":
            "no-such-section", "a reference to a module that does not exist": "no_such_module"}[breakage] in p.stderr


def test_the_repl_check_fails_a_block_that_only_works_as_a_file(tmp_path):
    """Issue 24: the README's quick start had a dedented line right after its ``try``/``except``: fine in a file,
    a ``SyntaxError`` pasted into the REPL. The check must fail such a block, and pass it with the blank line."""
    for text, ok in (('d = {}\ntry:\n    d[1]\nexcept KeyError as e:\n    print("not stored:", e)\nprint("done")\n', False),
                     ('d = {}\ntry:\n    d[1]\nexcept KeyError as e:\n    print("not stored:", e)\n\nprint("done")\n', True)):
        for name, content in (("_setup.py", ""), ("_snippet.py", text), ("_teardown.py", "")):
            (tmp_path / name).write_text(content)
        p = subprocess.run([sys.executable, "-c", REPL, "-", str(tmp_path)], capture_output=True, text=True,
                           timeout=60, check=False)
        assert (p.returncode == 0) is ok, p.stderr
        assert ("SyntaxError" in p.stderr) is not ok and ("done" in p.stdout) is ok


def test_the_built_site_loads_no_script_or_stylesheet_from_the_network(tmp_path):
    """Issue 31: every page loaded highlight.js and its stylesheet from a CDN, so offline the code had no colours.
    The site built here references no external script or stylesheet (nor a stylesheet that imports one), and its
    code blocks come highlighted from the build (Pygments' spans), with their colours in a local stylesheet."""
    p = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    site = tmp_path / "site"
    external = re.compile(r"""<script\b[^>]*\bsrc=["']?(?:https?:)?//|<link\b[^>]*\bhref=["']?(?:https?:)?//""", re.I)
    found = {f"{page.relative_to(site)}: {m.group(0)}" for page in site.rglob("*.html")
             for m in external.finditer(page.read_text())}
    found |= {f"{css.relative_to(site)}: {m.group(0)}" for css in site.rglob("*.css")
              for m in re.finditer(r"""(?:@import\s+|url\(\s*["']?)(?:https?:)?//[^)"'\s]+""", css.read_text())}
    assert found == set(), sorted(found)[:10]
    page = (site / "getting-started" / "index.html").read_text()
    assert '<div class="codehilite"><pre>' in page and '<span class="kn">import</span>' in page  # highlighted
    assert 'href="../css/pygments.css"' in page and ".codehilite .kn" in (site / "css" / "pygments.css").read_text()
    assert "hljs" not in page


def test_the_architecture_diagram_is_one_text_on_the_first_screen_and_the_concepts_page():
    """The README, the docs home and the concepts page show the same diagram of the tiers and the commit."""
    def diagram(page: str) -> str:
        (b,) = [b for b in blocks([REPO / page]) if b.lang == ""]
        return b.text

    first = diagram("README.md")
    assert diagram("docs/index.md") == first == diagram("docs/concepts.md")
    for part in ("host tier", "peer tier", "durable tier", "device tier", "vote(step, objects)", "committed",
                 "durable", "ckpt.restore()"):
        assert part in first, part


TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"


def _source_text() -> str:
    """The project's sources, adjacent string literals joined (a message split over lines reads whole)."""
    text = "".join(p.read_text() for d in ("tierstore", "backends", "consistency") for p in (REPO / d).rglob("*.py"))
    return re.sub(r"""(?<!\\)["']\s*\n\s*[rbfRBF]*["']""", "", text)


def test_every_message_the_troubleshooting_page_quotes_is_the_codes():
    """Each quoted message (a ``> `` line) names an error class of tierstore.errors and is the code's text, ``…``
    where the code puts a value: a message reworded in the code fails here until the page follows."""
    import tierstore.errors as errors

    quotes = [ln[2:] for ln in TROUBLESHOOTING.read_text().splitlines() if ln.startswith("> ")]
    assert len(quotes) >= 15, quotes
    source = _source_text()
    missing = []
    for quote in quotes:
        m = re.match(r"(\w+Error): (.*)", quote)
        if m:
            assert isinstance(getattr(errors, m[1], None), type) and issubclass(getattr(errors, m[1]),
                                                                                errors.TierStoreError), m[1]
        for part in (m[2] if m else quote).split("…"):
            if len(part.strip()) >= 8 and part not in source:
                missing.append(part)
    assert missing == [], missing
    named = set(re.findall(r"^> (\w+Error):", TROUBLESHOOTING.read_text(), re.M))
    assert {"TierUnavailableError", "TierFullError", "NoValidCopyError", "StepBusyError", "RestoreMismatchError",
            "InvalidValueError", "MissingDependencyError", "FencedError", "StepCommittedError"} <= named
