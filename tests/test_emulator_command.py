"""``python -m llama_guard.testing``: clear errors, and ``--faulty`` shows both defects to any client at once."""

from __future__ import annotations

import re
import select
import socket
import subprocess
import sys
import time

import httpx

from llama_guard.testing import open_burst

from .test_watch import emulator_process

CHAT = "/v1/chat/completions"
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "llama_guard.testing", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"python -m llama_guard.testing: cannot listen on 127.0.0.1:{port}: the port is in use (is llama-server "
        "or another emulator running there? pick another with --port, or --port 0 for any free one)"
    ]


def test_bad_numbers_name_the_argument() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "llama_guard.testing", "--stall-burst", "many"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "argument --stall-burst: expected a whole number, got 'many'" in result.stderr


def test_faulty_shows_both_defects_to_a_plain_client() -> None:
    """With --faulty alone, a burst of 16 new connections leaves 12 (those after the 4 HTTP threads) unread, and a
    plain pooled client loses the request after each stream."""
    with emulator_process("--faulty") as server:
        # The burst first, on a server no connection has reached yet: it is the whole burst, by construction.
        socks = open_burst("127.0.0.1", server.port, 16)
        try:
            for sock in socks:
                sock.sendall(HEALTH)
            answered = answered_sockets(socks, want=4, within=20.0)  # ends as soon as the 4 served ones answer
            assert len(answered) == 4
            # The other 12 stay unread until a served connection closes: none answers while all are open.
            assert answered_sockets([s for s in socks if s not in answered], want=1, within=0.5) == []
        finally:
            for sock in socks:
                sock.close()

        url = f"http://127.0.0.1:{server.port}"
        outcomes = []
        with httpx.Client(base_url=url) as client:
            for index in range(6):
                body = {"messages": [], "max_tokens": 2, "stream": index % 2 == 1}
                try:
                    with client.stream("POST", CHAT, json=body) as response:
                        response.read()
                        outcomes.append(response.status_code)
                except httpx.TransportError as exc:
                    outcomes.append(type(exc).__name__)
        assert outcomes[:2] == [200, 200]
        assert all(isinstance(item, str) for item in outcomes[2::2]), outcomes  # each request after a stream lost


def answered_sockets(socks: list[socket.socket], *, want: int, within: float) -> list[socket.socket]:
    """The sockets that received a first byte, waiting until ``want`` have or ``within`` seconds passed."""
    answered: list[socket.socket] = []
    deadline = time.monotonic() + within
    while len(answered) < want and (remaining := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([s for s in socks if s not in answered], [], [], remaining)
        answered += [sock for sock in readable if sock.recv(1)]
    return answered


def test_faulty_is_documented_in_help() -> None:
    result = subprocess.run([sys.executable, "-m", "llama_guard.testing", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert re.search(r"--faulty is --stream-close on_reuse --stall-burst 16", result.stdout.replace("\n", " "))
