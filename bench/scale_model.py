"""The scale model: a 40B model on 1024 GPUs, from costs measured here and published fabric figures.

    python -m bench.scale_inputs            # measure (writes bench/scale_inputs.json; ~2 min)
    python -m bench.scale_model [--inputs bench/scale_inputs.json] [--params 40e9] [--gpus 1024] ...

No simulation: every figure is a closed formula (below, and printed beside
its result) over three kinds of input, each named in the output:

* **measured** on this machine by :mod:`bench.scale_inputs` (the JSON):
  per-byte rates of one core (host-tier put and get, xxh3), per-message
  latencies of the index (vote, vote + ``WAIT``, a 1024-vote round), the
  index's messages and server CPU per object / rank / step of a real
  ``TierStore`` step, and the cluster's election overhead after a failure;
* **published** fabric figures (:data:`PUBLISHED`, each with its source);
* **assumed** deployment choices (:data:`ASSUMED` and the CLI flags):
  parallelism, bytes per parameter, cores per rank, network round trip.

Stages run concurrently on every GPU; a stage's time is the slowest resource
it crosses (transfers pipelined over a rank's objects: ``max`` of the
rates), plus the index messages it waits for in sequence.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ASSUMED", "PUBLISHED", "Scenario", "main", "model"]

GB = 1e9
MiB = 1 << 20

# value, unit, source
PUBLISHED: dict[str, tuple[float, str, str]] = {
    "hbm_GBps": (3350, "GB/s", "H100 SXM HBM3 bandwidth (NVIDIA H100 datasheet); a copy reads and writes: half"),
    "pcie_GBps": (64, "GB/s", "PCIe Gen5 x16, one direction (H100 SXM: 128 GB/s bidirectional, NVIDIA datasheet)"),
    "ib_GBps": (50, "GB/s", "400 Gb/s NDR InfiniBand, one ConnectX-7 per GPU (NVIDIA DGX H100 user guide)"),
    "s3_put_rps": (3500, "req/s", ("S3 PUT/COPY/POST/DELETE per partitioned prefix (Amazon S3 user guide, "
                                  "'Best practices design patterns: optimizing Amazon S3 performance')")),
    "s3_get_rps": (5500, "req/s", "S3 GET/HEAD per partitioned prefix (same page)"),
    "s3_conn_MBps": (87.5, "MB/s", ("one S3 request per 85-90 MB/s of throughput (AWS whitepaper 'Optimizing "
                                   "Amazon S3 Performance', horizontal scaling)")),
    "node_timeout_s": (15, "s", "cluster-node-timeout default 15000 ms (redis.conf / valkey.conf)"),
}

ASSUMED: dict[str, tuple[float, str, str]] = {
    "node_s3_GBps": (12.5, "GB/s", "a 100 Gb/s front-end NIC per node carries the S3 traffic"),
    "rtt_s": (100e-6, "s", "TCP round trip to the index inside one datacenter (loopback here: measured ping)"),
    "s3_latency_s": (0.1, "s", ("one small S3 request (AWS's performance guidelines cite 100-200 ms first-byte "
                               "latency for small objects)")),
    "s3_partitions": (1, "", ("partitioned S3 prefixes the bucket has (1: a cold bucket; S3 splits hot prefixes "
                             "over time)")),
}


@dataclass(frozen=True)
class Scenario:
    """The job. Bytes per parameter: bf16 weights (2) + fp32 master, Adam m and v (12), ZeRO-1 over DP."""

    params: float = 40e9
    gpus: int = 1024
    gpus_per_node: int = 8
    tp: int = 8
    pp: int = 4
    layers: int = 48
    weight_bytes: float = 2
    optim_bytes: float = 12
    cores_per_rank: int = 1
    s3_conns_per_rank: int = 4  # the S3 backend's max_concurrency x 1 migration worker
    part_size: int = 16 * MiB  # the S3 backend's part size
    intervals_s: tuple[float, ...] = (10.0, 60.0)
    primaries: int = 3

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def objects_per_rank(self) -> int:
        return self.layers // self.pp + 1  # a rank's layers of its stage, + embedding/head/extra state


def _fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min"


def _fmt_b(b: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def model(inputs: dict[str, Any], sc: Scenario, pub: dict[str, float], asm: dict[str, float]) -> dict[str, Any]:
    """Every figure of the tables, with the formula that gives it."""
    pb, pm, ops = inputs["per_byte"], inputs["per_message"], inputs["index_ops"]
    hbm_copy = pub["hbm_GBps"] * GB / 2
    pcie, ib = pub["pcie_GBps"] * GB, pub["ib_GBps"] * GB
    host_put = pb["host_put_GBps"] * GB * sc.cores_per_rank
    host_get = pb["host_get_GBps"] * GB * sc.cores_per_rank
    peer_put, peer_get = ib * inputs["peer"]["put_vs_raw"], ib * inputs["peer"]["get_vs_raw"]
    s3_rank = min(pub["s3_conn_MBps"] * 1e6 * sc.s3_conns_per_rank, asm["node_s3_GBps"] * GB / sc.gpus_per_node)
    # a message to the index from a real network: the datacenter round trip + what the index and client add
    server_vote = max(0.0, pm["vote_s"] - pm["ping_s"])
    msg = asm["rtt_s"] + server_vote
    # WAIT 1 after a vote (loopback replica): it blocks the voter, not the primary, so it adds latency once
    ack = max(0.0, pm["vote_acked_s"] - pm["vote_s"])
    # the primary runs the votes of a step one after another: its CPU per vote, then the deciding vote
    # (which assembles the manifest of every rank's entries)
    deciding = max(0.0, pm["deciding_vote_s"] - pm["ping_s"]) * sc.gpus / pm["deciding_voters"]

    weights_gpu = sc.params * sc.weight_bytes / (sc.tp * sc.pp)
    optim_gpu = sc.params * sc.optim_bytes / sc.gpus
    full_gpu = weights_gpu + optim_gpu
    unique_gpu = sc.params * (sc.weight_bytes + sc.optim_bytes) / sc.gpus
    n_obj = sc.objects_per_rank
    out: dict[str, Any] = {"bytes": {
        "per GPU: weights shard (TP x PP)": weights_gpu, "per GPU: optimizer shard (ZeRO-1)": optim_gpu,
        "per GPU: state": full_gpu, "per GPU: unique (DP replicas stored once)": unique_gpu,
        "job: all ranks' state": full_gpu * sc.gpus, "job: unique": unique_gpu * sc.gpus},
        "objects_per_step": n_obj * sc.gpus}

    save = {}
    for policy, written in (("exact", full_gpu), ("dedup", unique_gpu)):
        stall = written / hbm_copy
        host = max(written / pcie, written / host_put)
        records = n_obj * 2 * msg  # per object: the epoch check and the record script, in sequence
        # ... and the primary runs every rank's records one after another: its CPU per object, the share of
        # the put's 2 messages among the object's messages in a step (the rest come with its migration)
        per_obj = ops["single"]["server_cpu_s"]["per_object"] * 2 / ops["single"]["calls"]["per_object"]
        primary_records = sc.gpus * n_obj * per_obj
        commit = sc.gpus * pm["vote_server_cpu_s"] + deciding + msg
        commit_acked = sc.gpus * pm["vote_server_cpu_acked_s"] + deciding + msg + ack
        peer = written / peer_put
        obj_bytes = written / n_obj
        parts = math.ceil(obj_bytes / sc.part_size) + (2 if obj_bytes >= 64 * MiB else 0)
        put_reqs = sc.gpus * n_obj * parts
        s3_bw = written / s3_rank
        s3_req = put_reqs / (pub["s3_put_rps"] * asm["s3_partitions"])
        save[policy] = {
            "written per GPU": written,
            "stall (device snapshot, HBM copy)": stall,
            "host tier (D2H over PCIe, seal on the host; pipelined)": host,
            "index records, one rank (2 messages per object, in sequence)": records,
            "index records, the primary's CPU for every rank's": primary_records,
            "commit (the primary runs every rank's vote in turn, then the deciding one)": commit,
            "committed in memory (process-crash safe)": stall + max(host + records, primary_records) + commit,
            "  with replica-acknowledged commit (cluster, WAIT 1)":
                stall + max(host + records, primary_records) + commit_acked,
            "peer replica over IB (node-loss safe), after the host tier": stall + host + peer,
            "S3 bandwidth per rank": s3_bw,
            "S3 PUT request rate (whole job)": s3_req,
            "durable (S3; starts as each object reaches the host tier)": stall + max(host, s3_bw, s3_req),
        }
    out["save"] = save

    obj_full = full_gpu / n_obj
    get_reqs = sc.gpus * n_obj * math.ceil(obj_full / sc.part_size)
    # resolve: every rank reads the step's manifest (its size grows with the objects of the step) and its
    # objects' records; the primary serves the manifest reads one after another
    manifest_read = pm["manifest_read_cpu_s"] * (n_obj * sc.gpus) / pm["manifest_objects"]
    restore_index = n_obj * msg + msg + sc.gpus * manifest_read
    out["restore"] = {
        "failed step / rollback: device tier (HBM copy)": full_gpu / hbm_copy,
        "index: every rank reads the step's manifest from the primary": sc.gpus * manifest_read,
        "process crash: host tier on the node (verify, H2D; pipelined)":
            max(full_gpu / host_get, full_gpu / pcie) + restore_index,
        "node loss: the lost node's ranks read peer replicas over IB":
            max(full_gpu / peer_get, full_gpu / host_get, full_gpu / pcie) + restore_index,
        "cluster outage: every rank reads S3 (bandwidth)": full_gpu / s3_rank + restore_index,
        "cluster outage: every rank reads S3 (GET request rate)":
            get_reqs / (pub["s3_get_rps"] * asm["s3_partitions"]) + restore_index,
        "index primary lost: replica promoted (node timeout + election)":
            pub["node_timeout_s"] + inputs["failover"]["election_overhead_s"],
        "index lost, no replica: rebuild from the durable manifests (an existence check in S3 and a record "
        "per object, in sequence)": n_obj * sc.gpus * (asm["s3_latency_s"] + msg),
    }

    load = {}
    objects = n_obj * sc.gpus

    def at_scale(f: dict[str, float]) -> float:  # a coefficient the fit put below zero is noise: 0
        return max(0.0, f["per_object"]) * objects + max(0.0, f["per_rank"]) * sc.gpus + max(0.0, f["per_step"])

    for name, fit, primaries in (("one server, no acks", ops["single"], 1),
                                 ("primary + replica, WAIT 1", ops["replicated"], 1),
                                 (f"cluster of {sc.primaries} primaries + replicas, WAIT 1", ops["replicated"],
                                  sc.primaries)):
        calls, cpu = at_scale(fit["calls"]), at_scale(fit["server_cpu_s"])
        row = {"messages per step": calls, "server CPU per step (one core)": cpu,
               "most checkpoints per second of this job": 1 / cpu if cpu > 0 else math.inf}
        for t in sc.intervals_s:
            row[f"every {t:g} s: messages/s"] = calls / t
            row[f"every {t:g} s: its primary busy"] = cpu / t
            row[f"every {t:g} s: headroom"] = t / cpu if cpu > 0 else math.inf
            # a job's keys share one slot: a cluster adds room for more jobs (their models on other primaries),
            # not for one job
            row[f"every {t:g} s: jobs like this one it carries"] = primaries * math.floor(t / cpu) if cpu else 0
        load[name] = row
    out["load"] = load
    return out


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    lines = [f"| {title} | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def render(res: dict[str, Any], sc: Scenario, inputs: dict[str, Any], pub: dict[str, float],
           asm: dict[str, float]) -> str:
    parts = [(f"**Job**: {sc.params / 1e9:g}B parameters on {sc.gpus} GPUs ({sc.nodes} nodes x {sc.gpus_per_node}); "
             f"TP {sc.tp} x PP {sc.pp} x DP {sc.dp}, ZeRO-1; {sc.weight_bytes:g} + {sc.optim_bytes:g} bytes per "
             f"parameter; {sc.layers} layers, {sc.objects_per_rank} objects per rank per step "
             f"({res['objects_per_step']} per step); {sc.cores_per_rank} host core(s) per rank."), ""]
    parts.append(_table("state", [(k, _fmt_b(v)) for k, v in res["bytes"].items()]))
    parts.append("")
    keys = list(res["save"]["exact"])
    lines = ["| save, per step | exact | dedup (AdaCheck) |", "| --- | --- | --- |"]
    for k in keys:
        ex, dd = res["save"]["exact"][k], res["save"]["dedup"][k]
        f = _fmt_b if k.startswith("written") else _fmt_s
        lines.append(f"| {k} | {f(ex)} | {f(dd)} |")
    parts.append("\n".join(lines))
    parts.append("")
    parts.append(_table("restore, by failure class (per rank, all ranks at once)",
                        [(k, _fmt_s(v)) for k, v in res["restore"].items()]))
    parts.append("")
    names = list(res["load"])
    lines = ["| index load of the job (its keys share one slot: one primary) | " + " | ".join(names) + " |",
             "| --- |" + " --- |" * len(names)]
    for k in res["load"][names[0]]:
        vals = []
        for n in names:
            v = res["load"][n][k]
            if "jobs" in k:
                vals.append(f"{v:.0f}")
            elif "busy" in k:
                vals.append(f"{v * 100:.1f}%")
            elif "headroom" in k:
                vals.append(f"{v:.1f}x")
            elif "CPU" in k:
                vals.append(_fmt_s(v))
            elif "checkpoints per second" in k:
                vals.append(f"{v:.2f}")
            else:
                vals.append(f"{v:,.0f}")
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    parts.append("\n".join(lines))
    parts.append("")
    m = inputs["measured_on"]
    src = [(f"Measured ({m['date']}, {m['cpus']} CPUs, `{m['command'].strip()}`): "
           f"host put {inputs['per_byte']['host_put_GBps']:.2f} GB/s and get "
           f"{inputs['per_byte']['host_get_GBps']:.2f} GB/s per core, xxh3 {inputs['per_byte']['xxh3_GBps']:.1f} GB/s; "
           f"ping {inputs['per_message']['ping_s'] * 1e6:.0f} µs, vote {inputs['per_message']['vote_s'] * 1e6:.0f} µs, "
           f"vote + WAIT 1 {inputs['per_message']['vote_acked_s'] * 1e6:.0f} µs (cluster "
           f"{inputs['per_message']['vote_cluster_acked_s'] * 1e6:.0f} µs), "
           f"the primary's CPU per vote {inputs['per_message']['vote_server_cpu_s'] * 1e6:.0f} µs "
           f"({inputs['per_message']['vote_server_cpu_acked_s'] * 1e6:.0f} µs acked), the deciding vote of "
           f"{inputs['per_message']['deciding_voters']} {inputs['per_message']['deciding_vote_s'] * 1e3:.1f} ms, "
           f"its manifest {inputs['per_message']['manifest_bytes'] / 1e6:.2f} MB "
           f"({inputs['per_message']['manifest_read_cpu_s'] * 1e3:.2f} ms of server CPU per read); "
           f"index CPU per object {inputs['index_ops']['single']['server_cpu_s']['per_object'] * 1e6:.0f} µs "
           f"({inputs['index_ops']['single']['calls']['per_object']:.1f} messages) and per rank "
           f"{inputs['index_ops']['single']['server_cpu_s']['per_rank'] * 1e6:.0f} µs "
           f"({inputs['index_ops']['single']['calls']['per_rank']:.1f} messages; "
           f"{inputs['index_ops']['replicated']['calls']['per_rank']:.1f} acked); "
           f"a {inputs['per_message']['deciding_voters']}-vote round from 8 client threads "
           f"{inputs['per_message']['round_s'] * 1e3:.0f} ms (client-bound here); election "
           f"{inputs['failover']['election_overhead_s']:.2f} s after the node timeout; peer put/get "
           f"{inputs['peer']['put_vs_raw']:.2f}/{inputs['peer']['get_vs_raw']:.2f} of raw UCX.")]
    for name, table in (("Published", PUBLISHED), ("Assumed", ASSUMED)):
        vals = pub if name == "Published" else asm
        src.append(f"{name}: " + "; ".join(f"{k} = {vals[k]:g} {u} ({why})" for k, (_, u, why) in table.items()))
    parts.append("\n\n".join(src))
    return "\n".join(parts)


_FLAGS = ("params", "gpus", "gpus_per_node", "tp", "pp", "layers", "weight_bytes", "optim_bytes", "cores_per_rank",
          "s3_conns_per_rank", "primaries")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", default=str(Path(__file__).with_name("scale_inputs.json")))
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    d = Scenario()
    for f in _FLAGS:
        ap.add_argument("--" + f.replace("_", "-"), type=type(getattr(d, f)), default=getattr(d, f))
    for k, (v, _u, _why) in {**PUBLISHED, **ASSUMED}.items():
        ap.add_argument("--" + k.replace("_", "-"), type=float, default=v, help=_why)
    a = ap.parse_args(argv)
    sc = Scenario(**{f: getattr(a, f) for f in _FLAGS})
    if sc.gpus % (sc.tp * sc.pp) or sc.gpus % sc.gpus_per_node or sc.layers % sc.pp:
        ap.error("gpus must divide by tp x pp and by gpus-per-node; layers by pp")
    inputs = json.loads(Path(a.inputs).read_text())
    pub = {k: getattr(a, k) for k in PUBLISHED}
    asm = {k: getattr(a, k) for k in ASSUMED}
    res = model(inputs, sc, pub, asm)
    print(json.dumps(res, indent=1) if a.json else render(res, sc, inputs, pub, asm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
