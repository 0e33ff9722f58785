"""nginx in front of a server, as users deploy it: TLS termination and a reverse proxy with default settings.

Why (issue 22): two things a user may put in front of llama-server change what its defects cost. nginx's
``proxy_pass`` with its default upstream settings speaks HTTP/1.0 to the upstream and opens a new upstream
connection per request, so no connection idles on the server's threads (the recipe of
``docs/other-clients.md``); and TLS makes a new connection cost a handshake more. :class:`NginxFront` runs Debian's
nginx (``apt-get install nginx libnginx-mod-stream``) as a child process (``daemon off``), with its own prefix and
configuration in a temporary folder and free ports on 127.0.0.1, serving up to three fronts for one upstream:

- ``http_port``: ``proxy_pass`` with nginx's defaults (a new upstream connection per request);
- ``https_port``: the same behind TLS (a self-signed certificate, :attr:`NginxFront.ca_file` to trust it);
- ``tls_port``: TLS terminated by nginx's ``stream`` module and passed on as TCP, one upstream connection per
  client connection (as a server with TLS of its own would see its clients' connections).

Example::

    with NginxFront(("127.0.0.1", server.port), tmp_path) as front:
        httpx.get(f"http://127.0.0.1:{front.http_port}/health")
        httpx.get(f"https://127.0.0.1:{front.tls_port}/health", verify=front.ssl_context())
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._lifecycle import StartStop, end_process
from ._real_server import free_port

__all__ = ["NginxFront", "find_nginx", "self_signed_certificate"]

#: Where Debian's libnginx-mod-stream puts the stream module (the TLS-over-TCP front needs it).
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux's PR_SET_PDEATHSIG), so a
    killed benchmark leaves no nginx behind. Best effort elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def find_nginx() -> str | None:
    """The nginx binary (``NGINX_BIN`` or on PATH, also /usr/sbin), or None."""
    named = os.environ.get("NGINX_BIN")
    if named:
        return named if os.access(named, os.X_OK) else None
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def self_signed_certificate(folder: Path, addresses: Sequence[str] = ("127.0.0.1",)) -> tuple[Path, Path]:
    """A self-signed P-256 certificate valid for ``addresses`` (IPs) and ``localhost``, made by the openssl command:
    (certificate, key) in ``folder``. The certificate is its own authority: trust it with ``ssl_context()``."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    names = ",".join([*(f"IP:{address}" for address in addresses), "DNS:localhost"])
    command = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=llama-guard-test",
        "-addext",
        f"subjectAltName={names}",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=30)
    return cert, key


class NginxFront(StartStop):
    """nginx in front of ``upstream`` (see the module docstring); ``folder``: where its prefix goes (a temporary
    one by default, removed by :meth:`stop`). ``addresses``: the IPs the certificate must be valid for (the client
    may reach nginx through a relay on another address). ``stream=False`` leaves out the TLS-over-TCP front."""

    def __init__(
        self,
        upstream: tuple[str, int],
        folder: Path | None = None,
        *,
        addresses: Sequence[str] = ("127.0.0.1",),
        stream: bool = True,
        binary: str | None = None,
        worker_processes: str = "auto",
    ) -> None:
        self.upstream = upstream
        self.binary = binary or find_nginx()
        if self.binary is None:
            raise FileNotFoundError("no nginx binary: apt-get install nginx libnginx-mod-stream (or set NGINX_BIN)")
        self.stream = stream and STREAM_MODULE.exists()
        if stream and not self.stream:
            raise FileNotFoundError(f"no nginx stream module at {STREAM_MODULE}: apt-get install libnginx-mod-stream")
        self.addresses = tuple(addresses)
        self.worker_processes = worker_processes
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="llama-guard-nginx-")) if folder is None else Path(folder)
        self.http_port = 0
        self.https_port = 0
        self.tls_port = 0
        self.ca_file = self.folder / "cert.pem"
        self._process: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        up = f"{self.upstream[0]}:{self.upstream[1]}"
        folder = self.folder
        tls = f"ssl_certificate {folder / 'cert.pem'};\n        ssl_certificate_key {folder / 'key.pem'};"
        temp = "\n    ".join(
            f"{name}_temp_path {folder / name};" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        stream = (
            f"""
stream {{
    server {{
        listen 127.0.0.1:{self.tls_port} ssl;
        {tls}
        proxy_pass {up};
    }}
}}
"""
            if self.stream
            else ""
        )
        return f"""{f"load_module {STREAM_MODULE};" if self.stream else ""}
worker_processes {self.worker_processes};
daemon off;
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    {temp}
    server {{
        listen 127.0.0.1:{self.http_port};
        location / {{
            proxy_pass http://{up};
        }}
    }}
    server {{
        listen 127.0.0.1:{self.https_port} ssl;
        {tls}
        location / {{
            proxy_pass http://{up};
        }}
    }}
}}
{stream}"""

    def start(self, timeout: float = 10.0) -> NginxFront:
        if self._process is not None:
            raise RuntimeError("nginx is already started")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o755)  # nginx's workers run as nobody when started as root: they read the temp paths
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.folder / name).mkdir(exist_ok=True)
            (self.folder / name).chmod(0o777)
        if not (self.folder / "cert.pem").exists():
            self_signed_certificate(self.folder, self.addresses)
        self.http_port, self.https_port = free_port(), free_port()
        self.tls_port = free_port() if self.stream else 0
        conf = self.folder / "nginx.conf"
        conf.write_text(self.config())
        assert self.binary is not None
        command = [self.binary, "-p", str(self.folder), "-c", str(conf), "-e", str(self.folder / "error.log")]
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        ports = [p for p in (self.http_port, self.https_port, self.tls_port) if p]
        deadline = time.monotonic() + timeout
        while ports:
            if self._process.poll() is not None:
                error = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                self.stop()
                raise RuntimeError(f"nginx exited at start ({error.strip()[-2000:]}; {self.error_log()[-2000:]})")
            try:
                socket.create_connection(("127.0.0.1", ports[0]), timeout=0.5).close()
                ports.pop(0)
            except OSError as exc:
                if time.monotonic() >= deadline:
                    self.stop()
                    message = f"nginx did not listen within {timeout:g} s: {self.error_log()[-2000:]}"
                    raise RuntimeError(message) from exc
                time.sleep(0.02)
        return self

    def error_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "error.log").read_text(errors="replace")
        return ""

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts this front's certificate."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    def stop(self) -> None:
        """Stop nginx (SIGTERM, then SIGKILL to its process group after 5 s); remove its folder if made here."""
        process, self._process = self._process, None
        if process is not None:
            end_process(process, grace=5.0, kill=_kill_group)
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def _kill_group(process: subprocess.Popen[Any]) -> None:
    # nginx runs in a session of its own (start_new_session): SIGKILL its workers with the master.
    os.killpg(process.pid, signal.SIGKILL)
