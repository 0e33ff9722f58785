"""The nginx front of the benchmarks (llama_guard.testing._nginx.NginxFront) on real loopback sockets: its default
proxy opens a new upstream connection per request (the recipe of docs/other-clients.md), its TLS-over-TCP front
one per client connection, and the pre-opened burst sockets speak TLS through it. Skips without nginx."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator

import httpx
import pytest

from llama_guard.testing import burst_transport, open_burst
from llama_guard.testing._nginx import NginxFront, find_nginx

pytestmark = pytest.mark.skipif(
    find_nginx() is None, reason="no nginx: apt-get install nginx libnginx-mod-stream (.ci/run does)"
)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as llama-server

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args: object) -> None:
        pass


class CountingServer(http.server.ThreadingHTTPServer):
    """A keep-alive HTTP/1.1 server on loopback that counts the connections it accepted."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0

    def process_request(self, request: object, client_address: object) -> None:
        self.connections += 1
        super().process_request(request, client_address)  # type: ignore[arg-type]


@pytest.fixture
def upstream() -> Iterator[CountingServer]:
    server = CountingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def front(upstream: CountingServer) -> Iterator[NginxFront]:
    with NginxFront(("127.0.0.1", upstream.server_address[1])) as nginx:
        yield nginx


def test_default_proxy_opens_an_upstream_connection_per_request(upstream: CountingServer, front: NginxFront) -> None:
    """Four requests on one keep-alive client connection, plain and with TLS: four upstream connections each."""
    with httpx.Client(verify=front.ssl_context()) as client:
        for url in (f"http://127.0.0.1:{front.http_port}/", f"https://127.0.0.1:{front.https_port}/"):
            before = upstream.connections
            assert [client.get(url).text for _ in range(4)] == ["hello"] * 4
            assert upstream.connections - before == 4


def test_tls_stream_front_keeps_one_upstream_connection_per_client_connection(
    upstream: CountingServer, front: NginxFront
) -> None:
    """The TLS-over-TCP front passes one client connection on as one upstream connection (control for the test
    above: the same four requests, one upstream connection)."""
    with httpx.Client(verify=front.ssl_context()) as client:
        assert [client.get(f"https://127.0.0.1:{front.tls_port}/").text for _ in range(4)] == ["hello"] * 4
    assert upstream.connections == 1


def test_preopened_burst_socket_speaks_tls(upstream: CountingServer, front: NginxFront) -> None:
    """burst_transport hands a pre-opened TCP socket to httpx for an https origin: the TLS handshake runs on it,
    and the request uses it (no other connection is made)."""
    sockets = open_burst("127.0.0.1", front.tls_port, 1)
    transport = burst_transport(sockets, verify=front.ssl_context())
    with httpx.Client(transport=transport) as client:
        response = client.get(f"https://127.0.0.1:{front.tls_port}/")
        assert response.text == "hello"
        assert sockets[0].fileno() == -1  # its descriptor was taken over by the TLS socket: it was used
        assert client.get(f"https://127.0.0.1:{front.tls_port}/").text == "hello"
    assert upstream.connections == 1


def test_stop_leaves_no_nginx(upstream: CountingServer) -> None:
    """stop() ends the master and its workers (the pid file's process is gone) and removes the prefix."""
    nginx = NginxFront(("127.0.0.1", upstream.server_address[1]), stream=False).start()
    process = nginx._process
    assert process is not None
    folder = nginx.folder
    nginx.stop()
    assert process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)
    assert not folder.exists()
