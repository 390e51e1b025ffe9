"""``tierstore admin``: inspect (and collect garbage in) the Redis index and the tiers.

Usage::

    tierstore admin [CONNECTION] [--json] COMMAND [ARGS]

``--json``: the listings (``models``, ``steps``, ``layers``, ``nodes``, ``du``)
print one JSON record per line (JSON lines), ``watch`` one event per line,
the other commands one JSON document on one line
(:func:`tierstore.cli.common.print_json`).

    models                      models with steps, epoch, objects, bytes
    steps MODEL                 per step: state, attempt, age, votes/world, bytes per tier, memory-only
    show MODEL STEP             the step's manifest: layers x ranks (kind, size, tiers)
    layers MODEL                per layer: newest version, staleness, bytes
    where KEY                   which tiers hold model/layer/step/rank; reads and verifies each copy
    nodes                       the node agents: address, heartbeat TTL, capacity, used
    du [MODEL]                  bytes per model, tier and kind
    verify MODEL [STEP]         re-read every object from every tier and check its checksum
    watch MODEL                 live commits (pub/sub on ts:{MODEL}:events); --count N, --timeout S
    gc MODEL                    dry run unless --yes; --keep-last K --keep-durable N --keep-durable-every M
    rebuild-index [MODEL] --yes rebuild the index from the durable tier (every model without MODEL)
    delete MODEL                dry run unless --yes: the model's steps, copies per tier, durable manifests
                                and epoch records; refused while a writer looks live unless --force

Connection (all optional; the default is the embedded store of ``--home``,
``$TIERSTORE_HOME`` or ``./.tierstore``): ``--redis URL``, ``--s3
s3://bucket/prefix`` (or ``--durable file://dir``), ``--s3-endpoint URL``,
``--host-root DIR`` (the host tier to read for ``where``/``verify``).

Everything is read-only except ``gc --yes``, ``rebuild-index --yes`` and ``delete --yes``.
The store is opened with migration off, so the admin never moves data, and
with ``create=False``, so it never creates state: a home without an index
is an error ("no tierstore home at ...", exit 1), a missing host tier reads
as empty, and a home whose index server is stopped (``tierstore server
stop``) is refused with the command that starts it (``tierstore server
start --home HOME``, exit 1) unless ``--start-server`` is given; the server
such a flag starts keeps running (stop it with ``tierstore server stop``).
Only ``rebuild-index`` may create the index it rebuilds (and start its
server). No command imports torch.

Exit codes: 0 success; 1 an unknown model/step/key, an unreachable server
or another tierstore error; 2 bad arguments; 3 ``verify`` found a bad or
missing copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import tierstore
from consistency.gc import Retention
from consistency.lifecycle import IDLE_S
from tierstore.cli import views as V
from tierstore.cli.common import HelpFormatter, print_json
from tierstore.embedded import ping, socket_path
from tierstore.errors import ModelInUseError, ServerStoppedError, TierStoreError, UnknownError
from tierstore.home import is_index_dir
from tierstore.keys import ShardKey

__all__ = ["EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "EXIT_VERIFY", "build_parser", "main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_VERIFY = 0, 1, 2, 3


def _connection_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--home", default=argparse.SUPPRESS,
                   help="embedded store's data directory (default: $TIERSTORE_HOME, else .tierstore)")
    g.add_argument("--redis", default=argparse.SUPPRESS,
                   help="index URL (redis://, rediss://, unix://; a Redis Cluster node, or redis+cluster://) "
                        "(default: the embedded server of --home)")
    g.add_argument("--s3", "--durable", dest="durable", default=argparse.SUPPRESS,
                   help="durable tier: s3://bucket/prefix or file://dir (default: HOME/durable)")
    g.add_argument("--s3-endpoint", default=argparse.SUPPRESS,
                   help="S3-compatible endpoint URL (default: AWS, or $TIERSTORE_S3_ENDPOINT)")
    g.add_argument("--host-root", default=argparse.SUPPRESS,
                   help="the host tier's directory (default: derived from the home and node in /dev/shm)")
    g.add_argument("--node", default=argparse.SUPPRESS,
                   help="node id, which derives the default host tier (default: this host's name)")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="JSON instead of tables: listings (models, steps, layers, nodes, du) print one record "
                        "per line, the other commands one document on one line")
    return p


def _start_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--start-server", action="store_true", default=argparse.SUPPRESS,
                   help="start the embedded index server of --home when it is stopped; it keeps running after "
                        "the command (default: refuse, naming `tierstore server start --home HOME`)")
    return p


def build_parser() -> argparse.ArgumentParser:
    conn = _connection_parser()
    start = _start_parser()
    p = argparse.ArgumentParser(prog="tierstore admin", parents=[conn, start], formatter_class=HelpFormatter,
                                description="Inspect the tierstore index and tiers (read-only unless stated).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, parents=[conn, start], description=help_,
                              formatter_class=HelpFormatter)

    add("models", "models with steps, epoch, objects and bytes")
    add("steps", "per step: state, age, votes, bytes per tier").add_argument("model")
    s = add("show", "a step's manifest: layers x ranks")
    s.add_argument("model")
    s.add_argument("step", type=int)
    add("layers", "per layer: newest version, staleness, bytes").add_argument("model")
    add("where", "which tiers hold an object; reads and verifies each copy").add_argument(
        "key", help="model/layer/step/rank")
    add("nodes", "registered node agents")
    add("du", "bytes per model, tier and kind").add_argument("model", nargs="?")
    s = add("verify", "re-read objects from every tier and check checksums")
    s.add_argument("model")
    s.add_argument("step", type=int, nargs="?")
    s = add("watch", "live commit events of a model")
    s.add_argument("model")
    s.add_argument("--count", type=int, default=None, help="stop after N events (default: no limit)")
    s.add_argument("--timeout", type=float, default=None, help="stop after S seconds (default: until Ctrl-C)")
    s = add("gc", "collect garbage (dry run unless --yes)")
    s.add_argument("model")
    s.add_argument("--keep-last", type=int, default=2,
                   help="memory tiers keep the newest K committed steps (at least 1)")
    s.add_argument("--keep-durable", type=int, default=1,
                   help="the durable tier keeps the newest N durable steps (at least 1: the last line)")
    s.add_argument("--keep-durable-every", type=int, default=0,
                   help="the durable tier also keeps every M-th durable step (default: 0, none)")
    s.add_argument("--yes", action="store_true", help="really delete (default: a dry run that deletes nothing)")
    s = add("rebuild-index", "rebuild the index from the durable tier (needs --yes)")
    s.add_argument("model", nargs="?", help="the model to rebuild (default: every model in the durable tier)")
    s.add_argument("--yes", action="store_true", help="really rewrite the index (default: refuse)")
    s = add("delete", "delete a model from the index and every tier (dry run unless --yes)")
    s.add_argument("model")
    s.add_argument("--yes", action="store_true", help="really delete (default: a dry run that deletes nothing)")
    s.add_argument("--force", action="store_true",
                   help="delete even while a writer looks live (default: refuse)")
    s.add_argument("--idle", type=float, default=IDLE_S,
                   help="seconds since the newest step during which a writer counts as live")
    return p


def _open(a: argparse.Namespace, *, create: bool = False) -> Any:
    kw: dict[str, Any] = {"migrate": False, "create": create}
    if getattr(a, "host_root", None):
        kw["host_root"] = a.host_root
    if getattr(a, "node", None):
        kw["node_id"] = a.node
    if getattr(a, "s3_endpoint", None):
        kw["s3_endpoint_url"] = a.s3_endpoint
    home = getattr(a, "home", None) or os.environ.get("TIERSTORE_HOME") or ".tierstore"
    embedded = not getattr(a, "redis", None) and not os.environ.get("TIERSTORE_REDIS")
    if create and embedded and not any(os.path.isdir(os.path.join(home, d)) for d in ("index", "durable")):
        raise UnknownError(f"no tierstore home at {os.path.abspath(home)} (no index, no durable tier)", what="home")
    if embedded and not create and not getattr(a, "start_server", False):
        _refuse_stopped_server(home)
    return tierstore.open(home, redis=getattr(a, "redis", None), durable=getattr(a, "durable", None), **kw)


def _refuse_stopped_server(home: str) -> None:
    """Raise :class:`ServerStoppedError` when ``home`` holds an index whose embedded server does not answer:
    opening it would start the server (and leave it running), which a read-only command must not do."""
    path = Path(home).resolve()
    if not is_index_dir(path / "index") or ping(socket_path(path)):
        return  # no home (tierstore.open says so), or its server runs
    start = f"tierstore server start --home {shlex.quote(str(path))}"
    raise ServerStoppedError(f"the index server of {path} is stopped; start it with `{start}` "
                             "(or add --start-server to start it for this command; it keeps running)",
                             home=str(path), start=start)


# -- rendering -------------------------------------------------------------------------------
def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def human_age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _console(stderr: bool = False) -> Any:
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 160, highlight=False, soft_wrap=False)


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c in _RIGHT else "left", overflow="fold")
    for r in rows:
        t.add_row(*("-" if v is None else str(v) for v in r))
    return t


_RIGHT = {"step", "steps", "objects", "bytes", "votes", "epoch", "age", "newest", "staleness", "versions",
          "size", "capacity", "used", "pid", "uptime", "ttl left", "commit", "durable"}

_STATE_STYLE = {"committed": "green", "durable": "bold green", "aborted": "red", "preparing": "yellow"}


def _state(s: str) -> str:
    style = _STATE_STYLE.get(s)
    return f"[{style}]{s}[/]" if style else s


def _tiers_text(d: dict[str, int]) -> str:
    return ", ".join(f"{t} {human_bytes(n)}" for t, n in d.items()) or "-"


def _emit(a: argparse.Namespace, data: Any, render) -> None:
    if getattr(a, "json", False):
        print_json(data)
    else:
        render(_console(), data)
    sys.stdout.flush()  # a closed pipe (``| head``) raises here, where the dispatcher handles it


# -- commands --------------------------------------------------------------------------------
def _cmd_models(store, a) -> int:
    def render(c, rows):
        c.print(_table("models", ["model", "epoch", "steps", "states", "newest committed", "newest durable",
                                  "durable lag", "objects", "bytes"],
                       [[r["model"], r["epoch"], r["steps"], ", ".join(f"{k} {v}" for k, v in sorted(r["states"].items())),
                         r["newest_committed"], r["newest_durable"], _lag_text(r), r["objects"],
                         human_bytes(r["bytes"])] for r in rows]))
        if not rows:
            c.print("the index holds no model")
    _emit(a, V.models_view(store), render)
    return EXIT_OK


def _lag_text(r: dict[str, Any]) -> str:
    if r["newest_committed"] is None:
        return "-"
    if not r["durable_lag_steps"]:
        return "0"
    return f"{r['durable_lag_steps']} step(s), {r['durable_lag_s']:.1f} s"


def _cmd_steps(store, a) -> int:
    def render(c, rows):
        c.print(_table(f"steps of {a.model}", ["step", "state", "age", "commit", "to durable", "votes", "epoch",
                                               "objects", "bytes", "bytes per tier", "reason"],
                       [[r["step"], _state(r["state"]), human_age(r["age_s"]),
                         f"{r['commit_latency_s'] * 1e3:.1f} ms" if r["commit_latency_s"] is not None else None,
                         f"{r['to_durable_s']:.2f} s" if r["to_durable_s"] is not None else None,
                         f"{r['votes']}/{r['world']}", r["epoch"], r["objects"], human_bytes(r["bytes"]),
                         _tiers_text(r["bytes_per_tier"]), _reason(r)] for r in rows]))
        lag = V.lag_view(store, a.model)
        if lag["newest_committed"] is not None:
            c.print(f"durable lag: {_lag_text(lag)} (newest committed {lag['newest_committed']}, newest durable "
                    f"{lag['newest_durable'] if lag['newest_durable'] is not None else 'none'})")
        c.print(_retention_text(V.retention_view(store, a.model)), soft_wrap=True)
    _emit(a, V.steps_view(store, a.model), render)
    return EXIT_OK


def _retention_text(r: dict[str, Any]) -> str:
    """The footer of ``admin steps``: committed steps, how many are listed, and why the rest are not."""
    head = f"{r['committed']} step(s) committed, {r['listed']} listed"
    newest = f"newest durable {r['newest_durable'] if r['newest_durable'] is not None else 'none'}"
    if not r["retired"]:
        return f"{head}: retention retired none ({newest})"
    keep = f"keep_last={r['keep_last']}" if r["keep_last"] is not None else "its memory window"
    why = f"the last pass kept {_steps_text(r['memory'])} in memory ({keep})"
    if r["durable_only"]:
        why += f" and {_steps_text(r['durable_only'])} in the durable tier only"
    return (f"{head}: retention retired {r['retired']} (newest retired {r['newest_retired']}); {why}; {newest} "
            "(tierstore admin gc --help: the windows)")


def _steps_text(steps: list[int] | None) -> str:
    steps = steps or []
    if not steps:
        return "no step"
    return "step " + str(steps[0]) if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


def _reason(r: dict[str, Any]) -> str | None:
    reason = r["reason"]
    if r["aborted_after_s"] is not None:
        reason = f"{reason or 'aborted'} (after {r['aborted_after_s'] * 1e3:.1f} ms)"
    parts = (reason, r.get("memory_only") and f"memory-only: {r['memory_only']}",
             f"attempt {r['attempt']}" if (r.get("attempt") or 1) > 1 else None)
    return "; ".join(x for x in parts if x) or None


def _cmd_show(store, a) -> int:
    def render(c, d):
        ranks = [str(r) for r in range(d["world"])]
        rows = []
        for ln in d["layers"]:
            row: list[Any] = [ln]
            for r in ranks:
                cell = d["cells"][ln].get(r)
                if cell is None:
                    row.append("[dim]not saved[/]")
                    continue
                extra = f" -> {cell['base'] or cell['target']}" if cell["base"] or cell["target"] else ""
                row.append(escape(f"{cell['kind']} {human_bytes(cell['size'])} [{','.join(cell['tiers']) or 'no tier'}]{extra}"))
            rows.append(row)
        c.print(f"{d['model']} step {d['step']}: {_state(d['state'])}, world {d['world']}, epoch {d['epoch']}, "
                f"{human_bytes(d['bytes'])}")
        c.print(_table("layers x ranks (kind, size, tiers)", ["layer", *[f"rank {r}" for r in ranks]], rows))
    _emit(a, V.show_view(store, a.model, a.step), render)
    return EXIT_OK


def _cmd_layers(store, a) -> int:
    def render(c, rows):
        c.print(_table(f"layers of {a.model}", ["layer", "newest", "staleness", "versions", "kinds", "bytes (newest)",
                                                "bytes (all versions)"],
                       [[r["layer"], r["newest_version"], r["staleness"], r["versions"], ",".join(r["kinds"]),
                         human_bytes(r["bytes_newest"]), human_bytes(r["bytes_all_versions"])] for r in rows]))
    _emit(a, V.layers_view(store, a.model), render)
    return EXIT_OK


def _cmd_where(store, a) -> int:
    d = V.where_view(store, a.key)

    def render(c, d):
        rec = d["record"]
        if rec:
            c.print(f"{d['key']}: {rec['kind']}, {human_bytes(rec['size'])}, checksum {rec['checksum']}, "
                    f"index says {', '.join(rec['tiers']) or 'no tier'}")
        else:
            c.print(f"{d['key']}: [red]not in the index[/]")
        c.print(_table("copies", ["tier", "indexed", "present", "size", "checksum", "verifies"],
                       [[x["tier"], "yes" if x["indexed"] else "no", "yes" if x["present"] else "no",
                         x["size"], x["checksum"],
                         "-" if x["ok"] is None else ("[green]yes[/]" if x["ok"] else f"[red]NO[/] {escape(str(x['error']))}")]
                        for x in d["copies"]]))
    _emit(a, d, render)
    return EXIT_OK if all(x["ok"] is not False for x in d["copies"]) else EXIT_VERIFY


def _cmd_nodes(store, a) -> int:
    def render(c, rows):
        c.print(_table("nodes", ["node", "alive", "address", "capacity", "used", "pid", "uptime", "ttl left"],
                       [[r["node_id"], "[green]yes[/]" if r["alive"] else "[red]expired[/]", r["address"],
                         human_bytes(r["capacity"]) if r["capacity"] else "unbounded", human_bytes(r["used"]),
                         r["pid"], human_age(r["uptime_s"]), human_age(r["ttl_left_s"])] for r in rows]))
        if not rows:
            c.print("no node agent is registered")
    _emit(a, V.nodes_view(store.index), render)
    return EXIT_OK


def _cmd_du(store, a) -> int:
    def render(c, rows):
        c.print(_table("disk usage (index placement)", ["model", "tier", "kind", "objects", "bytes"],
                       [[r["model"], r["tier"], r["kind"], r["objects"], human_bytes(r["bytes"])] for r in rows]))
    _emit(a, V.du_view(store, a.model), render)
    return EXIT_OK


def _cmd_verify(store, a) -> int:
    keys = V.verify_keys(store, a.model, a.step)
    results = []
    with Progress(TextColumn("verify {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=_console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(a.model if a.step is None else f"{a.model} step {a.step}", total=len(keys))
        for r in V.verify_objects(store, keys):
            results.append(r)
            progress.advance(task)
    bad = [r for r in results if not r["ok"]]
    data = {"model": a.model, "step": a.step, "checked": len(results), "bad": len(bad), "results": results}

    def render(c, d):
        tiers = [t.tier for t in store.tiers]
        if bad:
            c.print(_table("bad objects", ["key", *tiers, "problems"],
                           [[r["key"], *[r["tiers"].get(t) for t in tiers], escape("; ".join(r["problems"]))] for r in bad]))
        verdict = "[green]all copies verify[/]" if not bad else f"[red]{len(bad)} object(s) with bad or missing copies[/]"
        c.print(f"checked {d['checked']} object(s) in tiers {', '.join(tiers)}: {verdict}")
    _emit(a, data, render)
    return EXIT_VERIFY if bad else EXIT_OK


def _cmd_watch(store, a) -> int:
    V.require_model(store, a.model)
    events = store.steps.subscribe(a.model)
    c = None if getattr(a, "json", False) else _console()
    if c is not None:
        c.print(f"watching step events of {a.model}; Ctrl-C to stop")
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    seen = 0
    try:
        while a.count is None or seen < a.count:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            got = events.get(timeout=wait)
            if got is None:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                continue
            step, state = got
            row = next((r for r in V.steps_view(store, a.model) if r["step"] == step), {})
            event = {"model": a.model, "step": step, "state": state, "time": store.index.server_time(),
                     "votes": row.get("votes"), "world": row.get("world"), "bytes": row.get("bytes"),
                     "commit_latency_s": row.get("commit_latency_s")}
            seen += 1
            if c is None:
                print_json(event)
                sys.stdout.flush()
            else:
                lat = event["commit_latency_s"]
                c.print(f"{time.strftime('%H:%M:%S', time.localtime(event['time']))}  step {step:>6}  {_state(state):<9}"
                        f"  votes {event['votes']}/{event['world']}  {human_bytes(event['bytes'])}"
                        + (f"  commit {lat * 1e3:.1f} ms" if lat is not None else ""))
    finally:
        events.close()
    if not seen:
        waited = f" in {a.timeout:g} s" if a.timeout is not None else ""
        print(f"no step events of {a.model}{waited}", file=sys.stderr if c is None else sys.stdout)
    return EXIT_OK


def _cmd_gc(store, a) -> int:
    V.require_model(store, a.model)
    if a.keep_last < 1 or a.keep_durable < 1 or a.keep_durable_every < 0:
        print("tierstore admin gc: --keep-last and --keep-durable must be >= 1 (the newest committed step is what "
              "a running trainer's next step builds on; the newest durable step is the last line), "
              "--keep-durable-every >= 0", file=sys.stderr)
        return EXIT_USAGE
    data = store.gc(a.model, Retention(a.keep_last, a.keep_durable_every, a.keep_durable),
                    dry_run=not a.yes).to_json()
    if data["dry_run"]:  # nothing was deleted: say what would be
        data["would_delete"], data["would_free_bytes"] = data.pop("deleted"), data.pop("bytes_freed")
    keys, nbytes = (data["would_delete"], data["would_free_bytes"]) if data["dry_run"] else \
        (data["deleted"], data["bytes_freed"])

    def render(c, d):
        verb = "would delete" if d["dry_run"] else "deleted"
        c.print(f"gc {a.model}: keep steps {d['kept_steps'] or '-'}; drop steps {d['dropped_steps'] or '-'}; "
                f"{verb} {len(keys)} object(s), {human_bytes(nbytes)}")
        for k in keys[:20]:
            c.print(f"  {k}")
        if len(keys) > 20:
            c.print(f"  ... and {len(keys) - 20} more")
        if d["durable_only"]:
            c.print(f"durable tier only: steps {d['durable_only']} ({'would release' if d['dry_run'] else 'released'} "
                    f"{len(d['released'])} memory copies, {human_bytes(d['bytes_released'])})")
        if d["deferred"]:
            c.print(f"left for a later pass: {len(d['deferred'])} object(s) of steps whose migration may still finish")
        if d["dry_run"]:
            c.print("dry run: nothing was deleted; add --yes to act")
    _emit(a, data, render)
    return EXIT_OK


def _cmd_rebuild(store, a) -> int:
    if not a.yes:
        print("tierstore admin rebuild-index rewrites the index from the durable tier: add --yes to proceed",
              file=sys.stderr)
        return EXIT_USAGE
    data = store.rebuild_index(a.model or None).to_json()

    def render(c, d):
        c.print("index rebuilt from the durable tier:")
        for k, v in d.items():
            c.print(f"  {k}: {json.dumps(v, default=str)}")
    _emit(a, data, render)
    return EXIT_OK


def _cmd_delete(store, a) -> int:
    if a.idle < 0:
        print("tierstore admin delete: --idle must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        data = store.delete_model(a.model, force=a.force, dry_run=not a.yes, idle_s=a.idle).to_json()
    except ModelInUseError as e:
        print(f"tierstore admin delete: {e}", file=sys.stderr)
        return EXIT_ERROR

    def render(c, d):
        verb = "would delete" if d["dry_run"] else "deleted"
        copies = ", ".join(f"{t} {n}" for t, n in d["copies"].items()) or "none"
        c.print(f"delete {a.model}: {verb} {len(d['steps'])} step(s) {d['steps'] or ''}, {d['index_keys']} index "
                f"key(s), copies: {copies}, {len(d['durable_manifests'])} durable manifest(s), "
                f"{d['epoch_records']} epoch record(s), {d['superseded_manifests']} superseded manifest(s)")
        for t, why in d["left"].items():
            c.print(f"  [red]{t}[/]: {escape(why)}")
        if d["live"]:
            c.print(f"[yellow]a writer looks live: {escape(d['live'])}[/]" +
                    (" (--yes alone is refused; add --force)" if d["dry_run"] else " (forced)"))
        if d["dry_run"]:
            c.print("dry run: nothing was deleted; add --yes to act")
    _emit(a, data, render)
    return EXIT_OK


_COMMANDS = {
    "models": _cmd_models, "steps": _cmd_steps, "show": _cmd_show, "layers": _cmd_layers, "where": _cmd_where,
    "nodes": _cmd_nodes, "du": _cmd_du, "verify": _cmd_verify, "watch": _cmd_watch, "gc": _cmd_gc,
    "rebuild-index": _cmd_rebuild, "delete": _cmd_delete,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tierstore admin``; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        a = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    if a.command == "where":
        try:
            ShardKey.parse(a.key)
        except TierStoreError as e:
            print(f"tierstore admin where: bad key {a.key!r}: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        store = _open(a, create=a.command == "rebuild-index" and a.yes)
    except (UnknownError, ServerStoppedError) as e:  # no home at --home, or its server stopped: nothing started
        print(f"tierstore admin {a.command}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except TierStoreError as e:
        print(f"tierstore admin: cannot open the store: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return _COMMANDS[a.command](store, a)
    except UnknownError as e:
        print(f"tierstore admin {a.command}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except TierStoreError as e:
        print(f"tierstore admin {a.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        try:
            store.close()
        except TierStoreError:
            pass
