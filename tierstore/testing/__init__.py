"""Test tooling shipped with the package: fault injection (:mod:`.faults`) and the demo's GPT (:mod:`.gpt`).

The library never imports it; tests, benchmarks and the demo do.
"""
