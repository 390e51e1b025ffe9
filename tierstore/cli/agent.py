"""``tierstore agent``: the command line of the node agent (the daemon itself is :mod:`tierstore.agent`).

    tierstore agent --node-id N --host-root DIR --secret-file F [--port P] [--redis URL] [...]

Builds an :class:`~tierstore.agent.AgentConfig` from the options and runs
:func:`tierstore.agent.run_agent` until SIGTERM or SIGINT; prints
``tierstore-agent ready node=<id> port=<port>`` once listening. Also
``python -m tierstore.cli.agent``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tierstore.agent import AgentConfig, read_secret, run_agent
from tierstore.cli.common import HelpFormatter

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierstore agent", description="Serve this node's host tier to peers over UCX.",
                                formatter_class=HelpFormatter, epilog="Needs ucxx: pip install 'tierstore[ucx]'.")
    p.add_argument("--node-id", required=True, help="this node's id, as peers and the index name it (required)")
    p.add_argument("--host-root", required=True, help="host tier directory, e.g. /dev/shm/tierstore/node0 (required)")
    p.add_argument("--port", type=int, default=0, help="UCX listener port (default: 0, any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address advertised to peers")
    p.add_argument("--secret-file", required=True, help="file holding the peers' shared secret (required)")
    p.add_argument("--redis", default=None, help="redis:// URL to register this node in (default: no registration)")
    p.add_argument("--capacity-bytes", type=int, default=None, help="the host tier's budget (default: unbounded)")
    p.add_argument("--max-object-bytes", type=int, default=AgentConfig.max_object_bytes,
                   help="the largest object a peer may put")
    p.add_argument("--ttl", type=float, default=AgentConfig.ttl_s, help="registration TTL in seconds")
    for flag, field in (("--handshake-timeout", "handshake_timeout_s"), ("--idle-timeout", "idle_timeout_s"),
                        ("--header-timeout", "header_timeout_s"), ("--io-timeout", "io_timeout_s"),
                        ("--sweep-interval", "sweep_interval_s"), ("--report-interval", "report_interval_s")):
        p.add_argument(flag, type=float, default=getattr(AgentConfig, field), help="seconds (see AgentConfig)")
    p.add_argument("--max-connections", type=int, default=AgentConfig.max_connections,
                   help="open connections at most (the oldest unauthenticated one is evicted first)")
    p.add_argument("--max-unauthenticated", type=int, default=AgentConfig.max_unauthenticated,
                   help="connections still in their handshake at most")
    p.add_argument("--max-peer-unexpected-bytes", type=int, default=AgentConfig.max_peer_unexpected_bytes,
                   help="what one connection may send unasked before it is closed (a well-behaved peer sends none)")
    p.add_argument("--no-shm-lanes", action="store_true", help="never offer same-host clients a shared-memory lane")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="expose Prometheus metrics on 127.0.0.1:PORT, with tierstore[metrics] (default: off)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints ``tierstore-agent ready node=<id> port=<port>`` when listening."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = AgentConfig(
        node_id=args.node_id, host_root=args.host_root, secret=read_secret(args.secret_file), port=args.port,
        host=args.host, redis_url=args.redis, capacity_bytes=args.capacity_bytes,
        max_object_bytes=args.max_object_bytes, ttl_s=args.ttl, heartbeat_s=max(0.2, args.ttl / 3),
        handshake_timeout_s=args.handshake_timeout, idle_timeout_s=args.idle_timeout,
        header_timeout_s=args.header_timeout, io_timeout_s=args.io_timeout, sweep_interval_s=args.sweep_interval,
        report_interval_s=args.report_interval, max_peer_unexpected_bytes=args.max_peer_unexpected_bytes,
        max_connections=args.max_connections, max_unauthenticated=args.max_unauthenticated,
        shm_lanes=not args.no_shm_lanes)

    if args.metrics_port is not None:
        from tierstore.cli.metrics import serve  # lazy: only with --metrics-port

        serve(args.metrics_port)

    def ready(port: int) -> None:
        print(f"tierstore-agent ready node={config.node_id} port={port}", flush=True)

    run_agent(config, ready=ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
