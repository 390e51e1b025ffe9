"""Merge the per-rank results into ``results.json`` and a markdown table ``results.md``.

A round's figure is the slowest rank's (a synchronous training step waits for
every rank). Medians with min-max over rounds; ratios to the ``copy`` bound
and to the best peer (lowest median among systems of kind ``peer``).
"""

from __future__ import annotations

import glob
import json
import os
import platform
import statistics
import sys
from typing import Any

import torch

__all__ = ["growth_rows", "machine_info", "merge_and_write", "render_growth", "render_markdown", "summarize"]


def machine_info() -> dict[str, Any]:
    """CPU, memory, versions and load, for the record."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
        "cpus": os.cpu_count(), "cpu_model": cpu, "mem_bytes": mem, "loadavg": list(os.getloadavg()),
        **_gpu(),
    }


def _gpu() -> dict[str, Any]:
    try:
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"gpu": f"{p.name} ({p.total_memory / 2**30:.0f} GiB)", "cuda": torch.version.cuda}
    except Exception:  # noqa: BLE001, S110 - a record, not a requirement
        pass
    return {}


def _stats(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: per-round max over ranks, then median/min/max; memory: max over ranks."""
    names = list(ranks[0]["systems"])
    out: dict[str, Any] = {}
    for name in names:
        recs = [r["systems"][name] for r in ranks if name in r["systems"]]
        first = recs[0]
        n = min(len(r["samples"]) for r in recs)
        fig: dict[str, Any] = {"kind": first["kind"], "describe": first["describe"]}
        for field in ("stall_s", "complete_s", "committed_s", "durable_s", "returns_s", "fwd_bwd_s",
                      "update_wait_s"):
            per_round = []
            for i in range(n):
                vals = [r["samples"][i].get(field) for r in recs]
                if all(v is not None for v in vals):
                    per_round.append(max(vals))
            fig[field] = _stats(per_round)
        nr = min(len(r["restore_s"]) for r in recs)
        fig["restore_s"] = _stats([max(r["restore_s"][i] for r in recs) for i in range(nr)])
        nv = min(len(r.get("verified_s", [])) for r in recs)
        fig["verified_s"] = _stats([max(r["verified_s"][i] for r in recs) for i in range(nv)
                                    if all(r["verified_s"][i] is not None for r in recs)])
        standing = max(r["standing_bytes"] for r in recs)
        transient = max(max(r["transient_bytes"], default=0) for r in recs)
        fig["extra_rss_bytes"] = max(max(r["first_peak_extra_bytes"] for r in recs), standing + transient)
        fig["standing_rss_bytes"] = standing
        fig["transient_rss_bytes"] = transient
        fig["shm_bytes"] = max(r["shm_bytes"] for r in recs)
        gpu = [r["gpu_extra_bytes"] for r in recs if "gpu_extra_bytes" in r]
        fig["gpu_extra_bytes"] = max(gpu) if gpu else None
        fig["shm_method"] = first["shm_method"]
        sl = [r.get("slowdown") for r in recs if r.get("slowdown")]
        vals = [s["slowdown"] for s in sl if s["slowdown"] is not None]
        fig["slowdown"] = statistics.median(vals) if vals else None
        fig["slowdown_mode"] = sl[0]["mode"] if sl else None
        fig["slowdown_busy_steps"] = min((len(s["busy_step_s"]) for s in sl), default=0)
        fig["extras"] = first.get("extras", {})
        out[name] = fig
    bound = out.get("copy", {}).get("stall_s")
    bound_r = out.get("copy", {}).get("restore_s")
    peers = [f for f in out.values() if f["kind"] == "peer"]
    best = min((f["stall_s"]["median"] for f in peers if f["stall_s"]), default=None)
    best_r = min((f["restore_s"]["median"] for f in peers if f["restore_s"]), default=None)
    for f in out.values():
        s, r = f["stall_s"], f["restore_s"]
        f["stall_vs_copy"] = s["median"] / bound["median"] if s and bound else None
        f["stall_vs_best_peer"] = s["median"] / best if s and best else None
        f["restore_vs_copy"] = r["median"] / bound_r["median"] if r and bound_r else None
        f["restore_vs_best_peer"] = r["median"] / best_r if r and best_r else None
        v = f.get("verified_s")
        f["verified_vs_copy"] = v["median"] / bound_r["median"] if v and bound_r else None
    return out


def _ms(st: dict[str, float] | None, spread: bool = True) -> str:
    if not st:
        return "—"
    if not spread or st["n"] == 1:
        return f"{st['median'] * 1e3:.0f}"
    return f"{st['median'] * 1e3:.0f} ({st['min'] * 1e3:.0f}–{st['max'] * 1e3:.0f})"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _gib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**30:+.2f}"


def render_markdown(res: dict[str, Any]) -> str:
    """The results table plus notes, as markdown."""
    cfg, summ = res["config"], res["summary"]
    gib = res["state_bytes_per_rank"] / 2**30
    gpu = any(f.get("gpu_extra_bytes") is not None for f in summ.values())
    lines = [
        f"# tierstore bench, {res['date']}",
        "",
        (f"{cfg['ranks']} ranks (gloo), {gib:.3f} GiB fp32 params + AdamW state per rank in "
         f"{cfg['tensors']} tensors ({cfg.get('tensors_per_layer', 4)} per layer), {cfg['repeats']} rounds "
         f"(systems alternate), "
         f"{cfg['threads']} torch thread(s) per rank; torch {res['machine']['torch']}, "
         f"{res['machine']['cpus']} CPUs ({res['machine']['cpu_model']}), load at start "
         f"{res['machine']['loadavg'][0]:.2f}, at end {res['loadavg_end'][0]:.2f}."),
        "Times in ms, median (min–max) of the slowest rank per round. Memory per rank in GiB.",
        "",
        ("| system | stall | × copy | × best peer | complete | committed | durable | restore (× copy) "
         "| extra RSS (private) | /dev/shm | training slowdown |" + (" extra GPU |" if gpu else "")),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if gpu else ""),
    ]
    if gpu:
        lines[2] += (f" State on {res['machine'].get('gpu', 'the GPU')}; the bound is a copy_ into pinned host "
                     "memory (restore: back from it).")
    for name, f in summ.items():
        stall = _ms(f["stall_s"])
        if f.get("returns_s"):
            stall += f" (returns at {_ms(f['returns_s'], spread=False)})"
        restore = "—" if not f["restore_s"] else f"{_ms(f['restore_s'])} ({_x(f['restore_vs_copy'])})"
        if f.get("verified_s"):
            restore += f"; verified {_ms(f['verified_s'], spread=False)} ({_x(f['verified_vs_copy'])})"
        sd = "—" if f["slowdown"] is None else f"{f['slowdown'] * 100:+.0f}%"
        lines.append(
            f"| `{name}` | {stall} | {_x(f['stall_vs_copy'])} | {_x(f['stall_vs_best_peer'])} | "
            f"{_ms(f['complete_s'])} | {_ms(f['committed_s'])} | {_ms(f['durable_s'])} | {restore} | "
            f"{_gib(f['extra_rss_bytes'])} | {_gib(f['shm_bytes'])} | {sd} |"
            + (f" {_gib(f.get('gpu_extra_bytes'))} |" if gpu else "")
        )
    lines += ["", "Systems:"]
    for name, f in summ.items():
        lines.append(f"- `{name}`: {f['describe']}.")
    lazy = {n: f for n, f in summ.items() if f.get("fwd_bwd_s")}
    if lazy:
        lines += ["", (f"Lazy systems (stall = time in the save call + wait before the update): a stand-in "
                       f"forward/backward of {cfg.get('fwd_bwd_s', 0) * 1e3:.0f} ms idle runs between the save "
                       "and the update; measured with the save running beside it: "
                       + "; ".join(f"`{n}` {_ms(f['fwd_bwd_s'])}, wait before the update {_ms(f['update_wait_s'])}"
                                   for n, f in lazy.items()) + ".")]
    ex = summ.get("copy", {}).get("extras", {})
    if "xxh3_128_gib_s" in ex:
        lines += ["", (f"Hashing: xxh3-128 over the state at {ex['xxh3_128_gib_s']:.2f} GiB/s per rank "
                       f"(both ranks at once); copy_ at {ex['copy_gib_s']:.2f} GiB/s per rank.")]
    modes = {f["slowdown_mode"] for f in summ.values() if f["slowdown_mode"]}
    lines += [
        "",
        "Notes: stall ends when the snapshot is safe from the next optimizer step (for async "
        "staging, when the staging future completes, not when the call returns). Extra RSS = peak "
        "RSS above the rank's RSS before the system's setup (standing buffers + transient peak), "
        "less mapped shared memory (RssShmem), which is counted under /dev/shm instead; "
        "/dev/shm = bytes the system holds there per rank after a save. Training slowdown = median "
        f"{cfg['matmul_n']}x{cfg['matmul_n']} matmul step while saving / idle − 1, overlap mode: "
        + "; ".join(sorted(modes)) + ". Restore is in-process (no process start-up), into the live "
        "tensors; `torch_save_disk` restores through the page cache; \"verified\": where a restore "
        "verifies its checksums beside the copy, when every one had matched (what the first update "
        "after a restore waits for).",
    ]
    if res["skipped"]:
        lines += ["", "Skipped:"] + [f"- `{k}`: {v}" for k, v in res["skipped"].items()]
    return "\n".join(lines) + "\n"


def merge_and_write(cfg: dict[str, Any]) -> dict[str, Any]:
    """Read ``raw/rank*.json`` under ``cfg['out']``; write ``results.json`` and ``results.md``."""
    paths = sorted(glob.glob(os.path.join(cfg["out"], "raw", "rank*.json")))
    ranks = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            ranks.append(json.load(f))
    skipped: dict[str, str] = {}
    for r in ranks:
        skipped.update(r["skipped"])
    res = {
        "date": cfg["date"],
        "machine": cfg["machine"],
        "loadavg_end": list(os.getloadavg()),
        "config": {k: v for k, v in cfg.items() if k not in ("machine", "init_method")},
        "state_bytes_per_rank": ranks[0]["state_bytes"],
        "skipped": skipped,
        "summary": summarize(ranks),
        "ranks": ranks,
    }
    with open(os.path.join(cfg["out"], "results.json"), "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    md = render_markdown(res)
    with open(os.path.join(cfg["out"], "results.md"), "w", encoding="utf-8") as f:
        f.write(md)
    return res


def _ratio(fig: dict[str, Any], field: str, bound: dict[str, Any] | None) -> float | None:
    st, b = fig.get(field), (bound or {}).get(field)
    return st["median"] / b["median"] if st and b and b["median"] else None


def growth_rows(runs: list[tuple[int, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """``tierstore bench --sweep``: per run (``ranks``, ``tensors``, its ``results.json``) and system other
    than the bound, the medians of that run over the ``copy`` bound of the same run: ``stall``,
    ``committed`` (over the copy's stall: the bound of a save), ``restore`` and ``verified`` (over the copy's
    restore); ``None`` where the system has no such figure or the run has no bound."""
    rows: list[dict[str, Any]] = []
    for ranks, tensors, res in runs:
        summ = res["summary"]
        copy = summ.get("copy")
        save_bound = {"committed_s": copy["stall_s"]} if copy else None
        restore_bound = {"verified_s": copy["restore_s"]} if copy else None
        for name, fig in summ.items():
            if fig["kind"] == "bound":
                continue
            rows.append({
                "ranks": ranks, "tensors": tensors, "system": name,
                "copy_stall_s": copy["stall_s"]["median"] if copy and copy["stall_s"] else None,
                "stall": _ratio(fig, "stall_s", copy),
                "committed": _ratio(fig, "committed_s", save_bound),
                "restore": _ratio(fig, "restore_s", copy),
                "verified": _ratio(fig, "verified_s", restore_bound),
            })
    return rows


def render_growth(rows: list[dict[str, Any]], size_gib: float) -> str:
    """The growth table of ``--sweep`` (:func:`growth_rows`) as markdown: a row per run and system."""
    lines = [
        f"## Growth with the number of tensors ({size_gib:g} GiB per rank)",
        "",
        ("Each figure: the system's median over the `copy` bound's median in the same run (committed: over "
        "the copy's stall; verified: over the copy's restore)."),
        "",
        ("| ranks | tensors | system | copy stall (ms) | stall × copy | committed × copy | restore × copy "
        "| verified × copy |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        copy_ms = "—" if r["copy_stall_s"] is None else f"{r['copy_stall_s'] * 1e3:.0f}"
        lines.append(f"| {r['ranks']} | {r['tensors']} | `{r['system']}` | {copy_ms} | {_x(r['stall'])} | "
                     f"{_x(r['committed'])} | {_x(r['restore'])} | {_x(r['verified'])} |")
    return "\n".join(lines) + "\n"
