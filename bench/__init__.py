"""Standalone benchmarks, run from a checkout: ``python -m bench.<name> --help``.

Not installed with the package. The side-by-side harness is ``tierstore bench``
(:mod:`tierstore.cli.bench`).
"""

__all__: list[str] = []
