"""Test tooling shipped with the package: fault injection (:mod:`.faults`), the demo's GPT (:mod:`.gpt`) and a
local Redis Cluster (:mod:`.rediscluster`).

The library never imports it; tests, benchmarks and the demo do.
"""
