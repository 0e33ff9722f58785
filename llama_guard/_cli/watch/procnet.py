"""Parse Linux's ``/proc/net/tcp`` and ``/proc/net/tcp6`` tables, and ``/proc/PID/fd`` socket links (no I/O).

Why these files and not ``ss``: they are always there, need no extra package, and give what ``watch`` needs for
every TCP socket of the network namespace: both endpoints, the state, the receive queue (bytes the kernel holds
that the owning process has not read yet) and the socket's inode (which ties it to a process through the
``socket:[INODE]`` links in ``/proc/PID/fd``).

A line of the table::

    sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
     0: 0100007F:1F90 0100007F:D3A6 01 00000000:0000002A 00:00000000 00000000  1000        0 482913 ...

Addresses are hexadecimal 32-bit words in the kernel's own byte order (little-endian on x86 and arm64), so
``0100007F`` is 127.0.0.1; IPv6 addresses are four such words. Ports are plain big-endian hexadecimal. The
queues are hexadecimal byte counts. Connections the server process has not accepted yet have inode 0.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CLOSE_WAIT",
    "ESTABLISHED",
    "LISTEN",
    "Endpoint",
    "TcpSocket",
    "decode_address",
    "parse_tcp_table",
    "socket_inode",
]

ByteOrder = Literal["little", "big"]

# The states watch cares about (include/net/tcp_states.h).
ESTABLISHED = 0x01
CLOSE_WAIT = 0x08
LISTEN = 0x0A

_STATE_NAMES = {
    0x01: "ESTABLISHED",
    0x02: "SYN_SENT",
    0x03: "SYN_RECV",
    0x04: "FIN_WAIT1",
    0x05: "FIN_WAIT2",
    0x06: "TIME_WAIT",
    0x07: "CLOSE",
    0x08: "CLOSE_WAIT",
    0x09: "LAST_ACK",
    0x0A: "LISTEN",
    0x0B: "CLOSING",
    0x0C: "NEW_SYN_RECV",
}


@dataclass(frozen=True, order=True)
class Endpoint:
    """One end of a TCP connection. IPv4-mapped IPv6 addresses are shown as IPv4, as people write them."""

    host: str
    port: int

    @property
    def is_wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::")

    def accepts(self, local: Endpoint) -> bool:
        """Is ``local`` (the server end of a connection) an address this listening endpoint accepts on?"""
        return self.port == local.port and (self.is_wildcard or self.host == local.host)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class TcpSocket:
    """One row of ``/proc/net/tcp*``."""

    local: Endpoint
    remote: Endpoint
    state: int
    tx_queue: int
    #: Bytes received and not yet read by the process (for a listening socket: connections waiting in accept()).
    rx_queue: int
    uid: int
    #: 0 for a connection no process holds yet (still in the listen queue) or one already closed by its process.
    inode: int

    @property
    def unread(self) -> int:
        """Bytes received and not read yet. Recv-Q counts a received FIN as one more until the process reads the
        end of the stream, so a CLOSE-WAIT socket whose client sent nothing shows Recv-Q 1: not a request."""
        if self.state == CLOSE_WAIT and self.rx_queue > 0:
            return self.rx_queue - 1
        return self.rx_queue

    @property
    def state_name(self) -> str:
        return _STATE_NAMES.get(self.state, f"0x{self.state:02X}")


def decode_address(text: str, *, byteorder: ByteOrder = sys.byteorder) -> Endpoint:
    """``0100007F:1F90`` -> 127.0.0.1:8080 (``byteorder``: the kernel's; the machine's own by default)."""
    address, sep, port_text = text.partition(":")
    if not sep or len(address) not in (8, 32):
        raise ValueError(f"not a /proc/net/tcp address (want 8 or 32 hex digits, a colon, a hex port): {text!r}")
    # Each 32-bit word is printed as a number in host order: turn it back into the bytes in memory.
    packed = b"".join(int(address[i : i + 8], 16).to_bytes(4, byteorder) for i in range(0, len(address), 8))
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    if len(packed) == 4:
        ip = ipaddress.IPv4Address(packed)
    else:
        ip = ipaddress.IPv6Address(packed)
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return Endpoint(str(ip), int(port_text, 16))


def parse_tcp_table(text: str, *, byteorder: ByteOrder = sys.byteorder) -> list[TcpSocket]:
    """Every socket of one ``/proc/net/tcp`` or ``/proc/net/tcp6`` table; raises ValueError on a malformed row."""
    sockets: list[TcpSocket] = []
    for number, line in enumerate(text.splitlines()):
        fields = line.split()
        if number == 0 or not fields:  # the header line
            continue
        if len(fields) < 10:
            raise ValueError(f"/proc/net/tcp row {number} has {len(fields)} fields, expected at least 10: {line!r}")
        tx_text, _, rx_text = fields[4].partition(":")
        sockets.append(
            TcpSocket(
                local=decode_address(fields[1], byteorder=byteorder),
                remote=decode_address(fields[2], byteorder=byteorder),
                state=int(fields[3], 16),
                tx_queue=int(tx_text, 16),
                rx_queue=int(rx_text, 16),
                uid=int(fields[7]),
                inode=int(fields[9]),
            )
        )
    return sockets


def socket_inode(link: str) -> int | None:
    """The inode of a ``/proc/PID/fd/N`` link target ``socket:[12345]``; None for anything else (files, pipes)."""
    if link.startswith("socket:[") and link.endswith("]"):
        digits = link[len("socket:[") : -1]
        if digits.isdigit():
            return int(digits)
    return None
