"""The node agent: owns a node's host tier and serves it to peers over UCX.

One agent runs per node (``tierstore agent --node-id N --host-root
/dev/shm/... --port P --secret-file F [--redis URL]``). It outlives trainer
crashes, so the host-tier copies it serves survive them, and peers on other
nodes read and write that tier through it (:class:`backends.peer.PeerBackend`).

Protocol: see :mod:`backends.agent_protocol`. The agent authenticates every
request (HMAC under the shared secret), validates every field (op, name,
lengths bounded by ``max_object_bytes``), never executes or unpickles what it
receives, and answers an error frame for a bad request while it keeps serving
every other connection. A put is received chunk by chunk straight into a
host-tier reservation (no second staging copy) and published only after the
whole payload arrived and its checksum matched, so a put cut short by a dead
peer leaves nothing readable.

Registration: with a Redis URL (or client), the agent writes the hash
``ts:node:<node_id>`` (node_id, address, capacity, used, pid, started) with a
TTL refreshed by a heartbeat thread, and adds the id to the set ``ts:nodes``;
a crashed agent's hash expires. A clean shutdown (SIGTERM/SIGINT) removes both.

Security: every connection gets a fresh challenge and every request is
signed for that connection and numbered (:mod:`backends.agent_protocol`), so
a captured frame is refused when replayed, on its own connection or another.
A connection must send an authentic request within ``handshake_timeout_s``
and then one at least every ``idle_timeout_s``; a put's payload must make
progress every ``header_timeout_s`` after ``READY`` or its reservation is
freed. At most ``max_connections`` connections are served (fewer if the fd
limit cannot fit them) and at most ``max_unauthenticated`` of them before
their first authentic request: a new one evicts the oldest unauthenticated
one, so a flood of idle connections cannot lock out a peer that has the
secret. The serving of one connection is :mod:`tierstore.agent.conn`.

Memory a peer sends unasked (:mod:`backends.ucx_server`): the agent's UCX
context has no active messages (they are dropped as they arrive); tag
messages no receive is posted for are received and dropped right after every
progress step of the worker, so UCX's unexpected queue never holds more than
one step's worth; stream bytes land in one posted buffer per connection.
What can be traced to a session (a tag under its session's base, stream
bytes on its endpoint) is charged to that connection, and one charged more
than ``max_peer_unexpected_bytes`` is closed with a logged reason. Drops are
logged once per ``report_interval_s``, and after a flood the agent hands the
freed heap back to the system.

Network note: ``ucxx`` listeners bind every interface of the agent's network
namespace (ucxx has no bind address); ``host`` is only the address advertised
to peers. Inside a network namespace (``tierstore testbed --netns``) "every
interface" is that namespace's loopback and its veth, so the agent is
reachable on the node's own address and nowhere else; on a host it is every
interface of the host. Authentication is what keeps other hosts out; firewall
the port on untrusted networks. ``UCX_NET_DEVICES`` must name the interface
peers reach (``lo`` only on one machine).

Layout (no import circle; checked by ``tests/test_layering.py``): :mod:`tierstore.agent.base`
(:class:`AgentConfig`, :class:`DigestCache`, the :class:`~tierstore.agent.base.AgentHost` protocol a
connection sees) <- :mod:`tierstore.agent.conn` (one connection) and :mod:`tierstore.agent.unasked` (what
peers send unasked) <- :mod:`tierstore.agent.server` (:class:`Agent`, :class:`NodeRegistration`,
:func:`run_agent`). The command line (``tierstore agent``, ``python -m tierstore.cli.agent``) is
:mod:`tierstore.cli.agent`; the agent never imports the CLI.
"""

from __future__ import annotations

from tierstore.agent.base import AgentConfig, DigestCache
from tierstore.agent.server import Agent, NodeRegistration, read_secret, run_agent
from tierstore.agent.unasked import UNEXPECTED_MESSAGE_COST

__all__ = ["UNEXPECTED_MESSAGE_COST", "Agent", "AgentConfig", "DigestCache", "NodeRegistration", "read_secret",
           "run_agent"]
