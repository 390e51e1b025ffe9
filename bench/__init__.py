"""Standalone benchmarks, run from a checkout: ``python -m bench.<name> --help``.

Not installed with the package. The side-by-side harness is ``tierstore bench``
(:mod:`tierstore.bench`).
"""

__all__: list[str] = []
