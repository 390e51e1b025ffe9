"""Weights files outside tierstore: Hugging Face safetensors (sharded, with an index) and ``torch.save``.

The one owner of these formats in the project. Write side (export), streaming:

* :class:`SafetensorsWriter` writes Hugging Face's layout: ``model.safetensors``
  when everything fits in one shard, else ``model-0000N-of-0000M.safetensors``
  plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": N},
  "weight_map": {name: file}}``). A tensor goes into the current shard while
  the shard stays within ``max_shard_bytes`` (a bigger tensor gets a shard of
  its own), as ``transformers`` shards. Each tensor's bytes are appended to a
  spool file in the output directory as it arrives (one spool per element size,
  so that the final file keeps every tensor aligned without holes); when a
  shard is full its header is written and the spools are copied after it
  (``os.copy_file_range``). The writer itself holds no tensor: memory is the
  caller's.
* :class:`TorchWriter` spools every tensor the same way and, at :meth:`TorchWriter.close`,
  ``torch.save``\\ s one flat ``{name: tensor}`` dict (``pytorch_model.bin``)
  whose tensors are memory-mapped views of the spool (file-backed pages, not
  the process's heap).

Files are written under temporary names and renamed when complete; the index
is written last (the commit record of the export). Nothing of a failed export
is left but what the caller asked for before.

Read side (import), lazy: :func:`open_source` lists a directory or file's
tensor names, shapes and dtypes from the headers, and reads one tensor at a
time: safetensors through ``safetensors.safe_open`` (memory-mapped; a dependency
of the base install, imported only here, so an install made with
``--no-deps`` gets :class:`~tierstore.errors.MissingDependencyError` naming it), a ``torch.save`` file through
``torch.load(weights_only=True, mmap=True)`` (never a general unpickler).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierstore.errors import CorruptObjectError, InvalidValueError, KeyExistsError, MissingDependencyError

__all__ = [
    "INDEX_FILE",
    "INSTALL_HINT",
    "SINGLE_FILE",
    "TORCH_FILE",
    "SafetensorsWriter",
    "TorchWriter",
    "WeightsSource",
    "open_source",
    "parse_size",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
INSTALL_HINT = "pip install 'tierstore[safetensors]'"
_COPY_CHUNK = 64 << 20

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` / ``500MB`` / ``2GiB`` / an int (``transformers``' ``max_shard_size`` units).

    Raises:
        InvalidValueError: not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE.match(str(size))
        if m is None:
            raise InvalidValueError(f"not a size: {size!r} (e.g. 5GB, 500MB, 2GiB)", key="max_shard_size")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise InvalidValueError(f"size must be positive, got {size!r}", key="max_shard_size")
    return n


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` (contiguous, C order) as a uint8 array, without a copy when it is contiguous."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _copy_into(dst: Any, src_path: Path) -> None:
    """Append the file ``src_path`` to the open file ``dst`` (flushed), in the kernel where it can."""
    with open(src_path, "rb") as src:
        left = os.fstat(src.fileno()).st_size
        try:
            while left > 0:
                n = os.copy_file_range(src.fileno(), dst.fileno(), min(left, 1 << 30))
                if n == 0:
                    break
                left -= n
        except OSError:  # another file system, an old kernel: both offsets moved by what was copied
            pass
        if left > 0:
            shutil.copyfileobj(src, dst, _COPY_CHUNK)
            dst.flush()


def _refuse_existing(out: Path, overwrite: bool) -> None:
    if overwrite:
        return
    taken = sorted(p.name for p in out.glob("*")
                   if p.name in (INDEX_FILE, SINGLE_FILE, TORCH_FILE) or re.match(r"model-\d+-of-\d+\.safetensors$", p.name))
    if taken:
        raise KeyExistsError(f"{out} already holds an export ({', '.join(taken[:3])}); choose another directory "
                             "or overwrite", key=str(out))


# ---- writing ---------------------------------------------------------------------------------

@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: list[int]
    size: int
    offset: int  # within its spool


@dataclass
class _Spools:
    """Tensor bytes of one output file as they arrive, one spool per element size (alignment without holes)."""

    base: Path
    entries: dict[int, list[_Entry]] = field(default_factory=dict)
    files: dict[int, Any] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        es = t.element_size()
        f = self.files.get(es)
        if f is None:
            f = self.files[es] = open(f"{self.base}.{es}.spool", "wb")
            self.entries[es] = []
        raw = _raw(t)
        self.entries[es].append(_Entry(name, t.dtype, list(t.shape), raw.nbytes, f.tell()))
        f.write(raw.data)
        self.nbytes += raw.nbytes

    def order(self) -> list[int]:
        return sorted(self.files, reverse=True)

    def done(self) -> None:
        for f in self.files.values():
            f.close()

    def remove(self) -> None:
        self.done()
        for es in self.files:
            Path(f"{self.base}.{es}.spool").unlink(missing_ok=True)


class SafetensorsWriter:
    """Streams tensors into Hugging Face's safetensors layout in ``out``; see the module docstring.

    Protocol: ``add(name, tensor)`` for every tensor (any order, names unique),
    then ``close()`` (returns the files written), or ``abort()`` on failure.
    ``add`` returns once the tensor's bytes are in a spool file: the caller may
    drop the tensor.

    Args:
        out: the output directory (created).
        max_shard_bytes: the most tensor bytes per file (a bigger tensor gets its own file).
        metadata: the files' ``__metadata__`` (``{"format": "pt"}`` is always set).
        overwrite: replace an export already in ``out`` (else :class:`KeyExistsError`).
    """

    def __init__(self, out: Path, max_shard_bytes: int, metadata: dict[str, str] | None = None,
                 *, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        _refuse_existing(self.out, overwrite)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._done: list[Path] = []  # finished shards under temporary names
        self._weight_map: dict[str, int] = {}
        self._cur: _Spools | None = None
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._weight_map:
            raise InvalidValueError(f"tensor {name!r} written twice", key=name)
        if t.dtype not in ST_DTYPES:
            raise InvalidValueError(f"tensor {name!r}: safetensors has no dtype {t.dtype}", key=name)
        n = t.numel() * t.element_size()
        if self._cur is not None and self._cur.nbytes > 0 and self._cur.nbytes + n > self.max_shard_bytes:
            self._finish_shard()
        if self._cur is None:
            self._cur = _Spools(self.out / f".export-{len(self._done) + 1:05d}")
        self._cur.add(name, t)
        self._weight_map[name] = len(self._done)
        self.total += n

    def _finish_shard(self) -> None:
        sp = self._cur
        assert sp is not None
        sp.done()
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for es in sp.order():
            for e in sp.entries[es]:
                header[e.name] = {"dtype": ST_DTYPES[e.dtype], "shape": e.shape,
                                  "data_offsets": [offset + e.offset, offset + e.offset + e.size]}
            offset += sum(e.size for e in sp.entries[es])
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)  # the data starts 8-byte aligned
        path = self.out / f".export-{len(self._done) + 1:05d}.safetensors.partial"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            f.flush()
            for es in sp.order():
                _copy_into(f, Path(f"{sp.base}.{es}.spool"))
            f.flush()
            os.fsync(f.fileno())
        sp.remove()
        self._done.append(path)
        self._cur = None

    def close(self) -> list[str]:
        """Finish the last shard, give the files their names, write the index last; return the file names."""
        if self._cur is not None or not self._done:
            if self._cur is None:
                self._cur = _Spools(self.out / ".export-00001")
            self._finish_shard()
        m = len(self._done)
        names = [SINGLE_FILE] if m == 1 else [f"model-{i + 1:05d}-of-{m:05d}.safetensors" for i in range(m)]
        for tmp, name in zip(self._done, names):
            os.replace(tmp, self.out / name)
        stale = self.out / INDEX_FILE
        if m == 1:
            stale.unlink(missing_ok=True)  # an index of an older export in this directory would mislead
            return names
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {n: names[i] for n, i in self._weight_map.items()}}
        tmp = self.out / f".{INDEX_FILE}.partial"
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, stale)
        return [*names, INDEX_FILE]

    def abort(self) -> None:
        """Remove everything this writer wrote."""
        if self._cur is not None:
            self._cur.remove()
        for p in self._done:
            p.unlink(missing_ok=True)


class TorchWriter:
    """Streams tensors into one ``torch.save`` file (``pytorch_model.bin``, a flat ``{name: tensor}``).

    Same protocol as :class:`SafetensorsWriter`. The tensors are spooled to a
    file as they arrive; :meth:`close` saves memory-mapped views of it.
    """

    def __init__(self, out: Path, *, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        _refuse_existing(self.out, overwrite)
        self._spool = self.out / ".export-torch.spool"
        self._f = open(self._spool, "wb")
        self._entries: list[_Entry] = []
        self._names: set[str] = set()
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._names:
            raise InvalidValueError(f"tensor {name!r} written twice", key=name)
        self._names.add(name)
        pad = -self._f.tell() % 64
        if pad:
            self._f.write(b"\0" * pad)
        raw = _raw(t)
        self._entries.append(_Entry(name, t.dtype, list(t.shape), raw.nbytes, self._f.tell()))
        self._f.write(raw.data)
        self.total += raw.nbytes

    def close(self) -> list[str]:
        self._f.close()
        sd: dict[str, torch.Tensor] = {}
        for e in self._entries:
            if e.size == 0:
                sd[e.name] = torch.empty(e.shape, dtype=e.dtype)
                continue
            mm = np.memmap(self._spool, dtype=np.uint8, mode="c", offset=e.offset, shape=(e.size,))
            sd[e.name] = torch.from_numpy(mm).view(e.dtype).reshape(e.shape)
        tmp = self.out / f".{TORCH_FILE}.partial"
        try:
            torch.save(sd, tmp)
            del sd
            os.replace(tmp, self.out / TORCH_FILE)
        finally:
            tmp.unlink(missing_ok=True)
            self._spool.unlink(missing_ok=True)
        return [TORCH_FILE]

    def abort(self) -> None:
        self._f.close()
        self._spool.unlink(missing_ok=True)


# ---- reading ---------------------------------------------------------------------------------

def _safetensors() -> Any:
    try:
        import safetensors  # lazy: only reading its files needs it (a base dependency; --no-deps may leave it out)
    except ImportError as e:
        raise MissingDependencyError(f"reading safetensors files needs the safetensors package: {INSTALL_HINT}",
                                     package="safetensors", hint=INSTALL_HINT) from e
    return safetensors


@dataclass
class WeightsSource:
    """Tensors of a weights file or directory, read one at a time.

    Attributes:
        path: what was opened.
        kind: ``safetensors`` or ``torch``.
        specs: ``name -> (shape, dtype)`` of every tensor, from the headers.
        files: the files read.
        note: how the tensors were found (a ``torch.save`` dict nested under ``"model"``, ...).
    """

    path: Path
    kind: str
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    files: list[str]
    get: Callable[[str], torch.Tensor]
    close: Callable[[], None] = lambda: None
    note: str = ""

    def names(self) -> Iterator[str]:
        return iter(self.specs)


_ST_TORCH = {v: k for k, v in ST_DTYPES.items()}


def _open_safetensors(path: Path, files: list[Path]) -> WeightsSource:
    st = _safetensors()
    handles: dict[Path, Any] = {}
    where: dict[str, Path] = {}
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in files:
        if not f.is_file():
            raise CorruptObjectError(f"{f} (named by the index) does not exist", key=str(f))
        try:
            h = st.safe_open(str(f), framework="pt")
        except Exception as e:
            raise CorruptObjectError(f"{f} is not a readable safetensors file: {e}", key=str(f)) from e
        handles[f] = h
        for n in h.keys():
            if n in where:
                raise CorruptObjectError(f"tensor {n!r} is in both {where[n].name} and {f.name}", key=n)
            sl = h.get_slice(n)
            code = sl.get_dtype()
            if code not in _ST_TORCH:
                raise InvalidValueError(f"{f.name}: tensor {n!r} has dtype {code}, which torch cannot hold", key=n)
            where[n] = f
            specs[n] = (tuple(sl.get_shape()), _ST_TORCH[code])

    def get(name: str) -> torch.Tensor:
        return handles[where[name]].get_tensor(name)

    return WeightsSource(path, "safetensors", specs, [str(f) for f in files], get, handles.clear)


def _unnest(obj: Any, path: Path) -> tuple[dict[str, torch.Tensor], str]:
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, ""
    if isinstance(obj, dict):
        for k in ("state_dict", "model", "module", "model_state_dict"):
            v = obj.get(k)
            if isinstance(v, dict) and v and all(isinstance(x, torch.Tensor) for x in v.values()):
                return v, f"the tensors under {k!r}"
    kinds = sorted({type(v).__name__ for v in obj.values()}) if isinstance(obj, dict) else [type(obj).__name__]
    raise InvalidValueError(f"{path}: not a state dict of tensors (found {', '.join(kinds)}); save "
                            "model.state_dict() or a dict holding it under 'state_dict' or 'model'", key=str(path))


def _open_torch(path: Path) -> WeightsSource:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise CorruptObjectError(f"{path} is not a torch.save file loadable with weights_only=True: {e}",
                                     key=str(path)) from e
        obj = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (pre-zip) format
    except Exception as e:
        raise CorruptObjectError(f"{path} is not a torch.save file loadable with weights_only=True: {e}",
                                 key=str(path)) from e
    sd, note = _unnest(obj, path)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
    return WeightsSource(path, "torch", specs, [str(path)], sd.__getitem__, sd.clear, note)


def open_source(path: str | os.PathLike) -> WeightsSource:
    """Open a weights directory or file for reading; see the module docstring.

    A directory holds ``model.safetensors.index.json`` (sharded), else exactly
    one ``*.safetensors`` file, else one ``torch.save`` file (``pytorch_model.bin``,
    ``*.pt``, ``*.pth``, ``*.bin``). A file is read as safetensors if its name
    ends in ``.safetensors``, else as a ``torch.save`` file.

    Raises:
        MissingDependencyError: safetensors files without the ``safetensors`` package.
        CorruptObjectError: a malformed index or file. InvalidValueError: nothing to read.
    """
    p = Path(path)
    if p.is_file():
        return _open_safetensors(p, [p]) if p.suffix == ".safetensors" else _open_torch(p)
    if not p.is_dir():
        raise InvalidValueError(f"{p} does not exist", key=str(p))
    index = p / INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            files = sorted({str(v) for v in wm.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptObjectError(f"{index} is not a safetensors index: {e!r}", key=str(index)) from e
        if any("/" in f or f.startswith(".") for f in files):
            raise CorruptObjectError(f"{index} names files outside its directory", key=str(index))
        src = _open_safetensors(p, [p / f for f in files])
        if set(wm) != set(src.specs):
            odd = sorted(set(wm) ^ set(src.specs))
            raise CorruptObjectError(f"{index} and its files disagree on tensor {odd[0]!r} "
                                     f"({len(odd)} name(s))", key=odd[0])
        return src
    sts = sorted(p.glob("*.safetensors"))
    if len(sts) == 1:
        return _open_safetensors(p, sts)
    if len(sts) > 1:
        raise InvalidValueError(f"{p} holds {len(sts)} safetensors files and no {INDEX_FILE}", key=str(p))
    pts = sorted(f for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth") and f.is_file())
    if len(pts) == 1:
        return _open_torch(pts[0])
    raise InvalidValueError(f"{p}: no {INDEX_FILE}, no single *.safetensors file, no single torch.save file "
                            f"(found {sorted(f.name for f in p.iterdir())[:5]})", key=str(p))
