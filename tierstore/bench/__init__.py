"""``tierstore bench``: tierstore side by side with ``torch.save`` and ``torch.distributed.checkpoint``.

Run ``tierstore bench --help``. The figures are defined in BENCHMARKS.md:
stall (until the snapshot is safe from the next optimizer step), time to
complete/committed/durable, restore, extra host memory (RSS and /dev/shm) and
training slowdown, always in the same run with ratios to a ``copy_`` bound.
The standalone micro-benchmarks live in the repository's ``bench/`` folder
(``python -m bench.<name>`` from a checkout); they are not installed.
"""

__all__: list[str] = []
