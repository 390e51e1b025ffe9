"""An imported step as the Checkpointer sees it: the state document :mod:`tierstore.interop.importing` writes.

The document of an imported step is ``{"entries": {MODULE_KEY: <module entry>}, "imported": {"module":
MODULE_KEY, "files": [...]}}`` at step :data:`IMPORT_STEP`; this module owns that layout, the importer
writes it by these names. A restore that lands on such a step loads its one module into the state's one
module (:func:`adopt_import`), and a writer's restore seeds the policy's trackers from it
(:func:`import_seeds`, then :meth:`tierstore.train.saveplan.SavePlan.seed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tierstore.errors import RestoreMismatchError

__all__ = ["IMPORT_STEP", "MODULE_KEY", "adopt_import", "import_seeds", "is_imported"]

IMPORT_STEP = 0
MODULE_KEY = "model"

def is_imported(doc: Mapping[str, Any]) -> bool:
    return isinstance(doc.get("imported"), dict)


def adopt_import(state: Mapping[str, Any], doc: dict[str, Any], only: Iterable[str] | None,
                 ) -> tuple[dict[str, Any], list[str] | None]:
    """For a restore of an imported step: the document and ``only`` that load its module into the state's.

    Any other step: ``(doc, only)`` unchanged.

    Raises:
        RestoreMismatchError: the state does not hold exactly one module.
    """
    if not is_imported(doc):
        return doc, None if only is None else list(only)
    entry = (doc.get("entries") or {}).get(doc["imported"].get("module", MODULE_KEY))
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if entry is None or len(modules) != 1:
        raise RestoreMismatchError(f"an imported step restores into a state with exactly one module (this one has "
                                   f"{modules})", layer=None, tensor=None)
    keys = [modules[0]] if only is None or modules[0] in set(only) else []
    return {**doc, "entries": {modules[0]: entry}}, keys


def import_seeds(doc: Mapping[str, Any], res: Any, shards: Mapping[str, tuple[dict[str, torch.Tensor], dict]],
                 rank: int, world_size: int) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """``layer -> (version, tensors)`` a writer's trackers start from after restoring an imported step.

    Empty unless ``doc`` is an imported step's and ``res`` was written for
    ``world_size`` ranks: each layer whose object for ``rank`` is its own full
    object or a reference to another's (a delta against it then reads back).
    """
    if not is_imported(doc) or res.world_size != world_size:
        return {}
    out = {}
    for ln, (tensors, _meta) in shards.items():
        info = res.objects.get((ln, rank))
        if info is not None and info.kind in ("full", "ref"):
            out[ln] = (res.layers[ln], tensors)
    return out
