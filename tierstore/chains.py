"""Delta/ref chain lengths, so that a chain is cut where it is written, before a reader would refuse it.

A read follows at most ``max_delta_chain`` links (delta -> base, ref ->
target) from an object to its full base. :class:`ChainDepths` knows each
object's depth (links to its full base): from the objects this store
published (a bounded cache), else by walking the index's records. The store
asks it before writing a delta or a ref; one that would be too deep is
written as a full object instead (a new base), with the same contents.
"""

from __future__ import annotations

from consistency.index import Index
from tierstore.keys import ShardKey

__all__ = ["ChainDepths"]

_BOUND = 100_000


class ChainDepths:
    """Depths of objects' delta/ref chains. Thread-safe enough: a lost update only costs a walk."""

    def __init__(self, index: Index, limit: int) -> None:
        self.index = index
        self.limit = limit
        self._depths: dict[ShardKey, int] = {}

    def depth(self, key: ShardKey) -> int:
        """Links from ``key`` to its full base (0 for a full object; past the limit: some value over it).

        A broken chain (a link not in the index) counts only the links walked:
        it is unreadable whatever its length, and a read names the missing link.
        """
        walked: list[ShardKey] = []
        cur: ShardKey | None = key
        below = -1  # depth of what the walk stopped at (-1: walked[-1] is a full object)
        while cur is not None:
            if cur in self._depths:
                below = self._depths[cur]
                break
            if len(walked) > self.limit + 1:
                return len(walked)  # past the limit: the exact depth no longer matters
            rec = self.index.get_object(cur)
            if rec is None:
                return len(walked)
            walked.append(cur)
            cur = rec.base if rec.kind == "delta" else rec.target if rec.kind == "ref" else None
        for i, k in enumerate(reversed(walked)):
            self._remember(k, below + 1 + i)
        return below + len(walked) if walked else below

    def forget(self, model: str) -> None:
        """Drop what is known of ``model``'s objects (the model was deleted)."""
        for k in [k for k in list(self._depths) if k.model == model]:
            self._depths.pop(k, None)

    def published(self, key: ShardKey, link: ShardKey | None) -> None:
        """Record a new object of ``key``: full (``link`` None), or one link past ``link``."""
        if link is None:
            self._remember(key, 0)
        elif link in self._depths:
            self._remember(key, self._depths[link] + 1)
        else:
            self._depths.pop(key, None)

    def _remember(self, key: ShardKey, depth: int) -> None:
        if len(self._depths) > _BOUND:
            self._depths.clear()
        self._depths[key] = depth
