"""The demo's plot: the loss with the failure and the restore marked, over the bytes each step wrote by kind
against a full checkpoint of the same state (``tierstore demo`` draws it to ``demo.png``; needs
``tierstore[plot]``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["draw", "drawn"]

#: the PNG text key under which :func:`draw` records what it drew (see :func:`drawn`)
DRAWN_KEY = "tierstore:drawn"


def _plot(summary: dict[str, Any], path: Path) -> None:
    """Loss (the failure and the restore marked) over the bytes each step wrote, by kind, against the bytes of a
    full checkpoint of the same state (the dashed line): the gap is what the policy saved."""
    import matplotlib  # lazy: optional dependency (tierstore[plot])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional dependency (tierstore[plot])

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    for phase, style, label in (("phase0", "-", "before the failure"), ("phase1", "--", "after restore")):
        pts = summary["loss_curve"][phase]
        if pts:
            a1.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=label)
    a1.axvline(summary["kill_at"], color="red", linestyle=":", label=f"rank killed at step {summary['kill_at']}")
    if summary["restore"]["step"] is not None:
        a1.axvline(summary["restore"]["step"], color="green", linestyle=":",
                   label=f"restored step {summary['restore']['step']}")
    a1.set_ylabel("loss (rank 0)")
    a1.set_title(f"tierstore demo: {summary['world']} ranks, policy {summary['policy']}")
    a1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    steps = sorted(int(s) for s in summary["bytes_per_step"])
    per_step = {int(s): k for s, k in summary["bytes_per_step"].items()}
    full = {int(s): n for s, n in summary.get("full_bytes_per_step", {}).items()}
    mib = 1024 * 1024
    bottom = [0.0] * len(steps)
    for kind, color in (("full", "tab:blue"), ("delta", "tab:orange"), ("ref", "tab:green")):
        vals = [per_step[s].get(kind, 0) / mib for s in steps]
        if any(vals):
            a2.bar(steps, vals, bottom=bottom, color=color, label=f"written: {kind}")
            bottom = [b + v for b, v in zip(bottom, vals)]
    shown = [s for s in steps if s in full]
    if shown:
        a2.step(shown, [full[s] / mib for s in shown], where="mid", color="black", linestyle="--", linewidth=1.5,
                label="a full checkpoint of\nthe same state")
        written = sum(sum(per_step[s].values()) for s in shown)
        baseline = sum(full[s] for s in shown)
        a2.set_title(f"written {written / mib:.1f} MiB against {baseline / mib:.1f} MiB of full checkpoints "
                     f"({baseline / max(written, 1):.1f}x smaller)", fontsize=10)
        a2.set_ylim(0, max(max(bottom), max(full[s] for s in shown) / mib) * 1.15)
    a2.set_xlabel("step")
    a2.set_ylabel("MiB per step (all ranks)")
    a2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    what = {"loss": a1.get_legend_handles_labels()[1], "bytes": a2.get_legend_handles_labels()[1],
            "titles": [a1.get_title(), a2.get_title()]}
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={DRAWN_KEY: json.dumps(what)})
    plt.close(fig)


def drawn(path: Path) -> dict[str, list[str]]:
    """What the plot at ``path`` shows, in kind: its series and titles with every number written ``#`` (two
    runs of the demo draw the same kinds of things with other numbers). ``{}`` for a PNG not drawn by
    :func:`draw`."""
    from PIL import Image  # lazy: matplotlib's own dependency (tierstore[plot])

    with Image.open(path) as im:
        raw = im.info.get(DRAWN_KEY)
    if raw is None:
        return {}
    return {k: [re.sub(r"\d+(\.\d+)?", "#", label) for label in v] for k, v in json.loads(raw).items()}


def draw(summary: dict[str, Any], path: Path) -> str:
    """Draw the demo's plot to ``path``; return the path, or why it was not drawn and how to get it."""
    try:
        _plot(summary, path)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        return "not drawn: matplotlib is not installed (pip install 'tierstore[plot]')"
    return str(path)
