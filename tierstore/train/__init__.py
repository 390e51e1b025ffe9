"""What a trainer touches: the Checkpointer, its policies, layers, dedup, staggering, replay, resharding restores.

Built on the data path (:mod:`tierstore.store` and friends); the data path never
imports this package; the adapters (:mod:`tierstore.interop`) are built on it, never the reverse.
"""
