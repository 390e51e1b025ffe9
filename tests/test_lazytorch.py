"""torch imported on first use: the data path loads without it, and reading an object's table needs none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tierstore import codec, lazytorch

REPO = Path(__file__).resolve().parents[1]


def test_the_stand_in_is_torch_once_used():
    assert lazytorch.torch.Tensor is torch.Tensor and lazytorch.torch.float32 is torch.float32
    assert lazytorch.loaded() and lazytorch.torch.__name__ == "torch"


def test_the_static_dtype_table_matches_torch():
    assert set(codec.DTYPES) == set(codec.ITEMSIZE)
    for name, dtype in codec.DTYPES.items():
        assert dtype is getattr(torch, name) and dtype.itemsize == codec.ITEMSIZE[name], name


def test_the_data_path_imports_and_verifies_objects_without_torch(tmp_path):
    blob = codec.encode({"w": torch.arange(10, dtype=torch.float16), "b": torch.ones(3, dtype=torch.bool)},
                        {"m": 1})
    (tmp_path / "obj").write_bytes(blob)
    code = ("import sys\nfrom pathlib import Path\nimport tierstore.connect, tierstore.store, tierstore.cli.admin\n"
            "from tierstore import codec\nblob = Path(sys.argv[1]).read_bytes()\n"
            "info = codec.inspect(blob)\nassert codec.verify(blob) == info.checksum == codec.checksum(blob)\n"
            "assert [t.dtype for t in info.tensors] == ['float16', 'bool']\n"
            "print('torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "obj")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
