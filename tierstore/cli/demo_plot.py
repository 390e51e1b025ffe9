"""The demo's numbers and its plot (``tierstore demo`` draws it to ``demo.png``; the plot needs ``tierstore[plot]``).

:func:`figures` formats every number the demo shows, once, from the summary record: the terminal summary
prints those strings and :func:`draw` draws them (and records them in the PNG, :func:`numbers`), so the
summary and the picture cannot disagree. The plot has four panels: the loss with the failure and the
restore marked; the training-thread stall per save against ``torch.save`` of the same state; the restore
against ``torch.load`` of that file; and the bytes each step wrote, by kind, against a full checkpoint of the
same state, with what the policy did not write shown as such.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tierstore.cli.admin import human_bytes

__all__ = ["draw", "drawn", "figures", "numbers"]

#: the PNG text key under which :func:`draw` records what it drew (see :func:`drawn` and :func:`numbers`)
DRAWN_KEY = "tierstore:drawn"

#: what each policy leaves unwritten against a full checkpoint, for the plot's legend
_NOT_WRITTEN = {"dedup": "the ranks' identical tensors, stored once (dedup: refs)",
                "layerwise": "layers that changed too little (layerwise)",
                "differential": "what deltas spared (differential)"}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _bytes_shown(summary: dict[str, Any]) -> tuple[list[int], dict[int, dict[str, int]], dict[int, int]]:
    """The steps the bytes panel draws (those with both what was written and a full checkpoint's size)."""
    per_step = {int(s): k for s, k in summary.get("bytes_per_step", {}).items()}
    full = {int(s): n for s, n in summary.get("full_bytes_per_step", {}).items()}
    return sorted(s for s in per_step if s in full), per_step, full


def figures(summary: dict[str, Any]) -> dict[str, str]:
    """Every number the demo shows, formatted: the one source of the terminal summary's figures and the plot's.

    Keys: ``stall_median``/``stall_max`` (the Checkpointer's ``save()``, every rank's saves),
    ``torch_save_median``/``torch_save_max`` (``torch.save`` of the same state, every rank's repeats),
    ``restore`` (the slowest rank's restore), ``torch_load`` (``torch.load`` + ``load_state_dict`` of that
    file: the slowest rank's median), ``written``/``full``/``smaller``/``refs``/``steps`` (the bytes the drawn
    steps wrote, a full checkpoint of the same state at each of them, the ratio, the refs' share of what was
    written, the steps). A figure not measured is ``"-"``.
    """
    stall = summary.get("stall_s") or {}
    ts = summary.get("torch_save") or {}
    steps, per_step, full = _bytes_shown(summary)
    written = sum(sum(per_step[s].values()) for s in steps)
    baseline = sum(full[s] for s in steps)
    refs = sum(per_step[s].get("ref", 0) for s in steps)
    return {
        "stall_median": _ms(stall.get("median")),
        "stall_max": _ms(stall.get("max")),
        "torch_save_median": _ms((ts.get("save_s") or {}).get("median")),
        "torch_save_max": _ms((ts.get("save_s") or {}).get("max")),
        "restore": _ms((summary.get("restore") or {}).get("seconds")),
        "torch_load": _ms((ts.get("load_s") or {}).get("seconds")),
        "written": human_bytes(written),
        "full": human_bytes(baseline),
        "smaller": f"{baseline / max(written, 1):.1f}x" if steps else "-",
        "refs": human_bytes(refs),
        "steps": f"{steps[0]}-{steps[-1]}" if steps else "-",
    }


def _bars(ax: Any, title: str, rows: list[tuple[str, float | None, str]], colors: list[str]) -> None:
    """One horizontal bar per row (label, seconds, the figure's text), the figure written at its end."""
    ys = list(range(len(rows)))[::-1]
    top = max((v for _l, v, _t in rows if v is not None), default=0.0) * 1e3 or 1.0
    for y, (_label, v, text), color in zip(ys, rows, colors):
        ax.barh(y, 0.0 if v is None else v * 1e3, color=color, height=0.6)
        ax.text((0.0 if v is None else v * 1e3) + top * 0.02, y, text if v is not None else "not measured",
                va="center", fontsize=9)
    ax.set_yticks(ys, [label for label, _v, _t in rows], fontsize=9)
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)


def _plot(summary: dict[str, Any], path: Path) -> None:
    """The four panels (see the module docstring); every number on them comes from :func:`figures`."""
    import matplotlib  # lazy: optional dependency (tierstore[plot])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional dependency (tierstore[plot])

    f = figures(summary)
    fig = plt.figure(figsize=(10, 11))
    grid = fig.add_gridspec(3, 2, height_ratios=[3, 1.5, 3.2], hspace=0.45, wspace=0.55)
    a1 = fig.add_subplot(grid[0, :])  # created in this order: fig.axes is loss, bytes, stall, restore
    a2 = fig.add_subplot(grid[2, :], sharex=a1)
    a3 = fig.add_subplot(grid[1, 0])
    a4 = fig.add_subplot(grid[1, 1])
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
    a1.tick_params(labelbottom=True)

    stall, ts = summary.get("stall_s") or {}, summary.get("torch_save") or {}
    where = f"\n(a file in {ts['filesystem']})" if ts.get("filesystem") else ""
    _bars(a3, "training-thread stall per save (median)",
          [("tierstore\nsave()", stall.get("median"), f["stall_median"]),
           (f"torch.save{where}", (ts.get("save_s") or {}).get("median"), f["torch_save_median"])],
          ["tab:blue", "tab:gray"])
    _bars(a4, "restore after the failure (slowest rank)",
          [("tierstore\nrestore", (summary.get("restore") or {}).get("seconds"), f["restore"]),
           ("torch.load +\nload_state_dict", (ts.get("load_s") or {}).get("seconds"), f["torch_load"])],
          ["tab:green", "tab:gray"])

    steps, per_step, full = _bytes_shown(summary)
    mib = 1024 * 1024
    bottom = [0.0] * len(steps)
    for kind, color in (("full", "tab:blue"), ("delta", "tab:orange"), ("ref", "tab:green")):
        vals = [per_step[s].get(kind, 0) / mib for s in steps]
        if any(vals):
            label = f"written: {kind}" if kind != "ref" else f"written: ref ({f['refs']} in all)"
            a2.bar(steps, vals, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if steps:
        gap = [max(full[s] / mib - b, 0.0) for s, b in zip(steps, bottom)]
        if any(g > 0 for g in gap):
            policy = {p.strip() for p in str(summary["policy"]).split("+")}
            why = [text for p, text in _NOT_WRITTEN.items() if p in policy]
            a2.bar(steps, gap, bottom=bottom, facecolor="none", edgecolor="tab:gray", hatch="//", linewidth=0.5,
                   label="not written:\n" + ";\n".join(why or ["against a full checkpoint"]))
        a2.step(steps, [full[s] / mib for s in steps], where="mid", color="black", linestyle="--", linewidth=1.5,
                label="a full checkpoint of\nthe same state")
        a2.set_title(f"steps {f['steps']}: written {f['written']} against {f['full']} of full checkpoints "
                     f"({f['smaller']} smaller)", fontsize=10)
        a2.set_ylim(0, max(max(bottom), max(full[s] for s in steps) / mib) * 1.15)
    a2.set_xlabel("step")
    a2.set_ylabel("MiB per step (all ranks)")
    a2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    what = {"loss": a1.get_legend_handles_labels()[1], "bytes": a2.get_legend_handles_labels()[1],
            "titles": [a.get_title() for a in (a1, a3, a4, a2)],
            "bars": [t.get_text() for a in (a3, a4) for t in a.get_yticklabels()], "numbers": f}
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={DRAWN_KEY: json.dumps(what)})
    plt.close(fig)


def _recorded(path: Path) -> dict[str, Any]:
    from PIL import Image  # lazy: matplotlib's own dependency (tierstore[plot])

    with Image.open(path) as im:
        raw = im.info.get(DRAWN_KEY)
    return {} if raw is None else json.loads(raw)


def drawn(path: Path) -> dict[str, list[str]]:
    """What the plot at ``path`` shows, in kind: its series, titles and bars with every number written ``#``,
    and the names of the figures it shows (two runs of the demo draw the same kinds of things with other
    numbers). ``{}`` for a PNG not drawn by :func:`draw`."""
    rec = _recorded(path)
    out = {k: [re.sub(r"\d+(\.\d+)?", "#", label) for label in v] for k, v in rec.items() if k != "numbers"}
    if "numbers" in rec:
        out["numbers"] = sorted(rec["numbers"])
    return out


def numbers(path: Path) -> dict[str, str]:
    """The figures (:func:`figures`) the plot at ``path`` drew, as it drew them; ``{}`` for another PNG."""
    return dict(_recorded(path).get("numbers", {}))


def draw(summary: dict[str, Any], path: Path) -> str:
    """Draw the demo's plot to ``path``; return the path, or why it was not drawn and how to get it."""
    try:
        _plot(summary, path)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        return "not drawn: matplotlib is not installed (pip install 'tierstore[plot]')"
    return str(path)
