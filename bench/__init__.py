"""Benchmarks: tierstore side by side with ``torch.save`` and ``torch.distributed.checkpoint``.

Run ``python -m bench.run --help``. The figures are defined in BENCHMARKS.md:
stall (until the snapshot is safe from the next optimizer step), time to
complete/committed/durable, restore, extra host memory (RSS and /dev/shm) and
training slowdown, always in the same run with ratios to a ``copy_`` bound.
"""

__all__: list[str] = []
