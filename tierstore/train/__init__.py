"""What a trainer touches: the Checkpointer, its policies, layers, dedup, staggering, replay, the DCP adapter.

Built on the data path (:mod:`tierstore.store` and friends); the data path never
imports this package.
"""
