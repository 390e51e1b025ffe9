"""Gradient-log checkpoints with optimizer replay: the ``replay`` policy of the one Checkpointer.

``Checkpointer(store, name, state, policy=replay(base_every=20))`` writes a
full base every ``base_every`` steps and, in between, only the gradients the
optimizer consumed; its restore replays them and verifies a digest of the
weights (see :mod:`tierstore.train.gradlog` for the protocol).
:class:`ReplayCheckpointer` is that Checkpointer under the name it had before
replay became a policy: same ``save``/``wait``/``restore``/``close``, same
``restore()`` signature (``(step, extra)``; ``ckpt.report`` has the replay
details)::

    rc = ReplayCheckpointer(store, "gpt", model, opt, base_every=20)
    step, extra = rc.restore()           # (None, None) on a fresh job
    rep = rc.report                      # base_step, replayed, fell_back, reason
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from tierstore.train.checkpointer import Checkpointer
from tierstore.train.gradlog import (
    GRAD,
    LOG_LAYER,
    SUPPORTED_OPTIMIZERS,
    ReplayFallbackWarning,
    params_digest,
)
from tierstore.train.policies import replay
from tierstore.train.view import RestoreReport

__all__ = [
    "GRAD",
    "LOG_LAYER",
    "SUPPORTED_OPTIMIZERS",
    "ReplayCheckpointer",
    "ReplayFallbackWarning",
    "ReplayReport",
    "params_digest",
]

ReplayReport = RestoreReport
"""What a replay restore did: the Checkpointer's :class:`~tierstore.train.view.RestoreReport`."""


class ReplayCheckpointer(Checkpointer):
    """A :class:`~tierstore.train.checkpointer.Checkpointer` with ``policy=replay(base_every, base_offset)``.

    Args:
        store, model_name, module, optimizer, state: as for the Checkpointer;
            the optimizer must be SGD, Adam or AdamW.
        base_every: the most steps between bases.
        base_offset: bases fall on steps ``s`` with ``(s - base_offset) % base_every == 0``.
        **kwargs: the Checkpointer's other keyword arguments.

    Raises:
        ConfigError: an unsupported optimizer or a bad ``base_every``.
    """

    def __init__(self, store: Any, model_name: str, module: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, base_every: int = 20, base_offset: int = 0,
                 state: MutableMapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(store, model_name, module, optimizer, replay(base_every, base_offset), state=state,
                         **kwargs)
