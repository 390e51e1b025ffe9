"""The test Redis server of tests/redis_server.py under parallel runs: a port another worker took between
:func:`free_port` and the start is never mistaken for this server's."""

from __future__ import annotations

import redis

from tests.redis_server import RedisProcess


def test_a_taken_port_moves_the_first_start_to_another_and_the_server_is_its_own(tmp_path):
    other = RedisProcess(tmp_path / "other")
    other.workdir.mkdir()
    other.start()
    mine = RedisProcess(tmp_path / "mine")
    mine.workdir.mkdir()
    mine.port = other.port  # what a worker's free_port() can hand out just before another worker binds it
    try:
        mine.start()
        assert mine.port != other.port
        info = redis.Redis.from_url(mine.url).info("server")
        assert mine.proc is not None and int(info["process_id"]) == mine.proc.pid
        assert other.proc is not None and other.proc.poll() is None  # the other one is left alone
        mine.restart()  # a restart keeps the address the tests hold
        assert int(redis.Redis.from_url(mine.url).info("server")["process_id"]) == mine.proc.pid
    finally:
        mine.stop(kill=True)
        other.stop(kill=True)
