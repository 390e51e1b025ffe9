"""The benchmark workload and the host measurements it needs.

The workload is a GPT-style model state per rank: fp32 parameters plus AdamW
state (``exp_avg``, ``exp_avg_sq``, ``step``), grouped by layer. Every tensor
name carries the rank, so DCP writes every rank's bytes (identical plain
tensors are written once across ranks otherwise).

Memory figures read the kernel directly: ``VmRSS``/``VmHWM`` from
``/proc/self/status`` (the peak is reset by writing ``5`` to
``/proc/self/clear_refs``, so sampling costs nothing), and ``/dev/shm`` usage
by walking a directory or, where a system cannot name its files, from
``statvfs`` of the whole mount.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Peak",
    "Workload",
    "dir_bytes",
    "make_workload",
    "matmul_step",
    "rss_bytes",
    "rss_shmem_bytes",
    "set_step_device",
    "shm_used_bytes",
]

_COLS = 1024


@dataclass
class Workload:
    """One rank's model state.

    Attributes:
        rank: this rank.
        layers: layer name -> tensor name -> tensor (``param``, ``exp_avg``,
            ``exp_avg_sq``, ``step``; with more parameters per layer, the next
            ones' names end in their index: ``param1``, ``exp_avg1``, ...), the
            live training state.
        flat: ``"<layer>.<tensor>"`` -> tensor, the same tensors, flat.
        nbytes: total bytes of the state.
    """

    rank: int
    layers: dict[str, dict[str, torch.Tensor]]
    flat: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The flat state as DCP and ``torch.save`` see it (distinct names per rank)."""
        return self.flat

    def perturb(self) -> None:
        """Stand in for an optimizer step: change every tensor a little, in place."""
        for group in self.layers.values():
            for name, t in group.items():
                if name.startswith("step"):
                    t.add_(1)
                elif name.startswith("param"):
                    t.add_(1e-3)


def make_workload(rank: int, total_bytes: int, n_tensors: int = 200, seed: int = 0,
                  device: str = "cpu", per_layer: int = 4) -> Workload:
    """Build a state of about ``total_bytes`` in ``n_tensors`` tensors.

    Each parameter comes with three tensors of AdamW state (exp_avg, exp_avg_sq,
    a scalar step); a layer (one checkpoint object) holds ``per_layer // 4``
    parameters and their state (``per_layer`` tensors: 4, one parameter, by
    default; a transformer block of 9 parameters is 36), so there are
    ``n_tensors // per_layer`` layers; the three large tensors of each parameter
    are ``[rows, 1024]`` fp32, sized so the total comes to ``total_bytes``.
    Every element is written (random data), so the pages are resident.
    ``device``: where the state lives (``"cuda"``: the three large tensors of
    each layer on the GPU, the ``step`` scalar on the CPU, as AdamW keeps it).
    """
    if per_layer < 4 or per_layer % 4:
        raise ValueError(f"per_layer must be a positive multiple of 4 (a parameter and its AdamW state), got {per_layer}")
    n_params = per_layer // 4
    n_layers = max(1, n_tensors // per_layer)
    per_tensor = total_bytes / (n_layers * n_params * 3)
    rows = max(1, int(per_tensor // (_COLS * 4)))
    gen = torch.Generator().manual_seed(seed + rank)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    flat: dict[str, torch.Tensor] = {}
    nbytes = 0
    for i in range(n_layers):
        name = f"r{rank}.h{i:03d}"
        group: dict[str, torch.Tensor] = {}
        for j in range(n_params):
            tag = str(j) if j else ""
            group[f"param{tag}"] = torch.randn(rows, _COLS, generator=gen).to(device)
            group[f"exp_avg{tag}"] = (torch.randn(rows, _COLS, generator=gen) * 1e-3).to(device)
            group[f"exp_avg_sq{tag}"] = (torch.rand(rows, _COLS, generator=gen) * 1e-6).to(device)
            group[f"step{tag}"] = torch.tensor(float(i))
        layers[name] = group
        for tname, t in group.items():
            flat[f"{name}.{tname}"] = t
            nbytes += t.numel() * t.element_size()
    return Workload(rank=rank, layers=layers, flat=flat, nbytes=nbytes)


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def rss_bytes() -> int:
    """The resident set size of this process, in bytes."""
    return _status_kib("VmRSS") * 1024


def rss_shmem_bytes() -> int:
    """Resident shared-memory pages mapped by this process (``RssShmem``: /dev/shm
    files and shared segments), in bytes; they are counted in /dev/shm too."""
    try:
        return _status_kib("RssShmem") * 1024
    except KeyError:
        return 0


class Peak:
    """Peak RSS over a region, from the kernel's high-water mark.

    ``start()`` resets ``VmHWM`` to the current RSS (``/proc/self/clear_refs``);
    ``peak()`` reads it. Where the reset is refused, a sampling thread is the
    fallback (5 ms period).
    """

    def __init__(self) -> None:
        self.base = 0
        self._thread: Any = None
        self._stop = False
        self._max = 0
        self.method = "VmHWM"

    def start(self) -> Peak:
        self.base = rss_bytes()
        self.shmem_base = rss_shmem_bytes()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
        except OSError:
            self.method = "sampled"
            self._max = self.base
            self._stop = False

            def sample() -> None:
                while not self._stop:
                    self._max = max(self._max, rss_bytes())
                    time.sleep(0.005)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def private_extra(self) -> int:
        """Peak RSS above the start, less the growth of mapped shared memory (counted
        under /dev/shm instead, so it is not counted twice)."""
        return self.peak() - self.base - max(0, rss_shmem_bytes() - self.shmem_base)

    def peak(self) -> int:
        """Peak RSS since ``start()``, in bytes (stops the sampler if any)."""
        if self._thread is not None:
            self._stop = True
            self._thread.join()
            self._thread = None
            return max(self._max, rss_bytes())
        return _status_kib("VmHWM") * 1024


def dir_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def shm_used_bytes() -> int:
    """Bytes in use on /dev/shm as a whole (other processes count too)."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class _MatmulState:
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    c: torch.Tensor | None = None
    device: str = "cpu"


_MM = _MatmulState()


def set_step_device(device: str) -> None:
    """Where :func:`matmul_step` runs (``"cuda"``: on the GPU, each step's stream synchronised, as a real
    step's ``loss.item()`` would; other streams, such as a checkpoint's copies, are not waited for)."""
    _MM.device = device
    _MM.a = _MM.b = None


def matmul_step(n: int = 384) -> float:
    """One stand-in training step (an ``n x n`` fp32 matmul, on :func:`set_step_device`'s device); its seconds."""
    if _MM.a is None or _MM.a.shape[0] != n:
        _MM.a = torch.randn(n, n, device=_MM.device)
        _MM.b = torch.randn(n, n, device=_MM.device)
        _MM.c = torch.empty(n, n, device=_MM.device)
    t0 = time.perf_counter()
    if _MM.device != "cpu":  # into a standing buffer: GPU memory figures see no temporaries of the stand-in
        c = torch.mm(_MM.a, _MM.b, out=_MM.c)  # type: ignore[arg-type]
        _MM.a.add_(c, alpha=1e-9)
        torch.cuda.current_stream().synchronize()  # the trainer's stream only: a side stream's copies run on
        return time.perf_counter() - t0
    c = _MM.a @ _MM.b  # type: ignore[operator]
    _MM.a.add_(c, alpha=1e-9)
    return time.perf_counter() - t0
