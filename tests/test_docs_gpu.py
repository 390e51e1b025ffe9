"""``docs/gpu.md``'s snippets, run as written (on the CPU path where there is no CUDA device)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "gpu.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_page_has_its_snippets():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_snippet_runs(i, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the snippets' homes under the test's directory
    exec(compile(BLOCKS[i], f"docs/gpu.md[{i}]", "exec"), {"__name__": f"docs_gpu_{i}"})
    assert capsys.readouterr().out  # each prints what it shows
