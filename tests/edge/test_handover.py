"""The hand-over of an edge's sockets to a successor (``iopd.edge.handover``,
``iopd.transport.sockets``): the inherited-socket variables, and the failures
that leave the old edge serving.  The whole hand-over through real processes is
``tests/system/test_restart.py``."""

from __future__ import annotations

import logging
import os
import socket
import sys

import trio

from iopd.edge.handover import HANDOVER_FD_ENV, Successor
from iopd.transport.sockets import LISTEN_FDS_ENV, Inherited, open_listeners
from tests.support.configs import echo_yaml
from tests.support.gateway import http_request, running_gateway, wait_until


def test_own_variable_is_read_by_name_and_removed() -> None:
    env = {LISTEN_FDS_ENV: "openai=5,6;admin=7;wire=8", "LISTEN_FDS": "2"}
    inherited = Inherited.from_environ(env)
    assert env == {}  # neither variable reaches a child of this process
    assert inherited._fds == {"openai": [5, 6], "admin": [7], "wire": [8]}


def test_systemd_variables_count_from_fd_3_and_check_the_pid() -> None:
    env = {"LISTEN_FDS": "3", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": "openai:admin:wire"}
    assert Inherited.from_environ(env)._fds == {"openai": [3], "admin": [4], "wire": [5]}
    other = {"LISTEN_FDS": "3", "LISTEN_PID": str(os.getpid() + 1)}
    assert not Inherited.from_environ(other)  # meant for another process


def test_malformed_variables_take_nothing_unbounded() -> None:
    assert not Inherited.from_environ({LISTEN_FDS_ENV: "openai=x,;=;"})
    many = ",".join(str(n) for n in range(10, 10_000))
    assert sum(len(v) for v in Inherited.from_environ({LISTEN_FDS_ENV: f"a={many}"})._fds.values()) == 64
    assert not Inherited.from_environ({"LISTEN_FDS": "lots"})


async def test_an_inherited_socket_is_listened_on_and_a_bad_one_skipped() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    plain = socket.socket()  # not listening: skipped, the name is bound as configured
    inherited = Inherited({"openai": [sock.detach()], "admin": [plain.detach()]})
    listeners = await open_listeners("openai", "127.0.0.1", 0, inherited)
    assert listeners[0].socket.getsockname()[1] == port
    admin = await open_listeners("admin", "127.0.0.1", 0, inherited)
    assert admin[0].socket.getsockname()[1] != port
    for listener in (*listeners, *admin):
        await listener.aclose()


def test_successor_pipe_is_read_from_the_environment() -> None:
    read_fd, write_fd = os.pipe()
    env = {HANDOVER_FD_ENV: str(write_fd)}
    successor = Successor.from_environ(env)
    assert env == {} and successor is not None
    successor.tell("wire")
    successor.close()
    assert os.read(read_fd, 64) == b"wire\n"
    os.close(read_fd)
    assert Successor.from_environ({}) is None


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", f"import os\nfd = int(os.environ['{HANDOVER_FD_ENV}'])\n{body}"]


async def _chat_ok(gw: object) -> None:
    resp = await http_request(
        gw.host_port,  # type: ignore[attr-defined]
        "POST",
        "/v1/chat/completions",
        body={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status == 200, resp.body


async def test_a_successor_that_fails_before_wire_leaves_everything_serving(caplog) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            gw.handle.successor_argv = _script("raise SystemExit(2)")
            gw.handle.hand_over()
            await wait_until(lambda: "handover_failed" in caplog.text)
            assert "exited with status 2 before it was ready" in caplog.text
            assert not gw.handle._drain.is_set()
            await _chat_ok(gw)


async def test_a_successor_that_fails_after_wire_gets_the_nodes_back(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            first = gw.runtime.hub.session("node-a")
            assert first is not None
            gw.handle.successor_argv = _script("os.write(fd, b'wire\\n')\nraise SystemExit(3)")
            gw.handle.hand_over()
            await wait_until(lambda: "handover_failed" in caplog.text)
            assert "nodes_told=1" in caplog.text
            # The node was told GoAway and dialled again: this edge accepts it again.
            await wait_until(
                lambda: (s := gw.runtime.hub.session("node-a")) is not None and s is not first
            )
            await _chat_ok(gw)
            gw.handle.hand_over()  # a later try is allowed again
            await wait_until(lambda: caplog.text.count("handover_failed") == 2)
