"""``llama-guard watch``: the /proc parsers, the stall tracker and the risk rule as tables, then the command end
to end against the emulator running as a real process, with real connections left unread by its pool defect."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from llama_guard._cli.main import WATCH_DESCRIPTION, main
from llama_guard._cli.watch.cmdline import Setting, is_llama_server, parse_server_command
from llama_guard._cli.watch.command import WatchOptions, run_watch
from llama_guard._cli.watch.proc import read_sockets
from llama_guard._cli.watch.procnet import (
    CLOSE_WAIT,
    ESTABLISHED,
    LISTEN,
    Endpoint,
    decode_address,
    parse_tcp_table,
    socket_inode,
)
from llama_guard._cli.watch.report import ServerView, assess, event_line
from llama_guard._cli.watch.stall import ConnectionKey, QueueSample, StallEvent, StallTracker
from llama_guard._core.llama_server import build_has_pool_defect, build_number, has_pool_defect, version_build_info
from llama_guard.testing import open_burst

HEALTH = b"GET /health HTTP/1.1\r\nHost: emu\r\n\r\n"

# -- /proc/net/tcp -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "byteorder", "expected"),
    [
        ("0100007F:1F90", "little", Endpoint("127.0.0.1", 8080)),
        ("7F000001:1F90", "big", Endpoint("127.0.0.1", 8080)),
        ("00000000:0000", "little", Endpoint("0.0.0.0", 0)),
        ("0101A8C0:D3A6", "little", Endpoint("192.168.1.1", 54182)),
        ("00000000000000000000000001000000:0050", "little", Endpoint("::1", 80)),
        ("00000000000000000000000000000000:1F90", "little", Endpoint("::", 8080)),
        # An IPv4 client of a server listening on [::]: the kernel shows it IPv4-mapped; people write it as IPv4.
        ("0000000000000000FFFF00000100007F:D3A6", "little", Endpoint("127.0.0.1", 54182)),
        ("B80D0120000000000000000001000000:1F90", "little", Endpoint("2001:db8::1", 8080)),
    ],
)
def test_addresses_decode_in_the_kernels_byte_order(text, byteorder, expected):
    assert decode_address(text, byteorder=byteorder) == expected


@pytest.mark.parametrize("text", ["0100007F", "0100007F:", "01007F:1F90", "0100007G:1F90", ""])
def test_malformed_addresses_are_rejected(text):
    with pytest.raises(ValueError):
        decode_address(text, byteorder="little")


TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000002 00:00000000 00000000  1000        0 482900 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D3A6 01 00000000:00000026 00:00000000 00000000  1000        0 482913 1 0 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:D3A8 08 00000000:00000026 00:00000000 00000000  1000        0 0 1 0 20 4 30 10 -1
   3: 0100007F:D3A6 0100007F:1F90 01 0000001A:00000000 00:00000000 00000000     0        0 482912 1 0 20 4 30 10 -1
"""


def test_a_table_parses_into_sockets():
    rows = parse_tcp_table(TABLE, byteorder="little")
    assert [(row.state, row.rx_queue, row.tx_queue, row.inode, row.uid) for row in rows] == [
        (LISTEN, 2, 0, 482900, 1000),
        (ESTABLISHED, 0x26, 0, 482913, 1000),
        (CLOSE_WAIT, 0x26, 0, 0, 1000),
        (ESTABLISHED, 0, 0x1A, 482912, 0),
    ]
    assert rows[1].local == Endpoint("127.0.0.1", 8080)
    assert rows[1].remote == Endpoint("127.0.0.1", 54182)
    assert rows[2].state_name == "CLOSE_WAIT"


def test_a_short_row_is_an_error_that_names_it():
    with pytest.raises(ValueError, match="row 1 has 3 fields"):
        parse_tcp_table("header\n 0: 0100007F:1F90 00000000:0000\n", byteorder="little")


@pytest.mark.parametrize(
    ("link", "inode"),
    [("socket:[482913]", 482913), ("pipe:[12]", None), ("/dev/null", None), ("socket:[]", None), ("socket:[1x]", None)],
)
def test_fd_links_name_socket_inodes(link, inode):
    assert socket_inode(link) == inode


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_kernels_own_table_shows_unread_bytes_on_the_server_socket(family):
    """Cross-check against the running kernel (the format, the byte order): a request this process sent and
    did not read shows as the server side's Recv-Q, on the right addresses."""
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family) as listener:
        listener.bind((host, 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection((host, port), timeout=5) as client:
            server_side, _ = listener.accept()
            with server_side:
                client.sendall(HEALTH)
                client_port = client.getsockname()[1]
                deadline = time.monotonic() + 5
                while True:  # the bytes are in the queue once sendall returned on loopback; poll all the same
                    rows = [
                        row
                        for row in read_sockets(Path("/proc"))
                        if row.local == Endpoint(host, port) and row.remote.port == client_port
                    ]
                    if (rows and rows[0].rx_queue == len(HEALTH)) or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                assert len(rows) == 1
                assert rows[0].state == ESTABLISHED
                assert rows[0].rx_queue == len(HEALTH)
                assert rows[0].remote == Endpoint(host, client_port)
                assert rows[0].inode == os.fstat(server_side.fileno()).st_ino


# -- command lines, builds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "threads", "parallel", "port", "base"),
    [
        (["/opt/llama-server", "-m", "m.gguf"], {}, None, None, 8080, "max(4+4, cpus-1)"),
        (["llama-server", "--threads-http", "2", "--port", "18089"], {}, 2, None, 18089, "2"),
        (["llama-server", "-np", "8"], {}, None, 8, 8080, "max(8+4, cpus-1)"),
        (["llama-server", "--parallel", "2", "--parallel", "3"], {}, None, 3, 8080, "max(3+4, cpus-1)"),
        (["llama-server", "--parallel=6"], {}, None, 6, 8080, "max(6+4, cpus-1)"),
        (["llama-server"], {"LLAMA_ARG_THREADS_HTTP": "12", "LLAMA_ARG_PORT": "9000"}, 12, None, 9000, "12"),
        (["llama-server", "--threads-http", "3"], {"LLAMA_ARG_THREADS_HTTP": "12"}, 3, None, 8080, "3"),
        (["llama-server", "--threads-http", "-1"], {}, -1, None, 8080, "max(4+4, cpus-1)"),
        (["llama-server", "--threads-http", "lots"], {}, None, None, 8080, "max(4+4, cpus-1)"),
        (["llama-server", "-np", "-1"], {}, None, -1, 8080, "max(4+4, cpus-1)"),
    ],
)
@pytest.mark.parametrize("cpus", [2, 64])
def test_llama_server_command_lines(argv, env, threads, parallel, port, base, cpus):
    command = parse_server_command(argv, env, exe=None)
    assert command.kind == "llama-server"
    assert command.threads_http.value == threads
    assert command.parallel.value == parallel
    assert command.port.value == port
    expected = {
        "max(4+4, cpus-1)": max(8, cpus - 1),
        "max(8+4, cpus-1)": max(12, cpus - 1),
        "max(3+4, cpus-1)": max(7, cpus - 1),
        "max(6+4, cpus-1)": max(10, cpus - 1),
    }.get(base)
    assert command.base_http_threads(cpus) == (expected if expected is not None else int(base))
    assert str(command.base_http_threads(cpus)) in command.explain_base(cpus)


def test_the_emulator_command_line_is_understood():
    argv = [sys.executable, "-m", "llama_guard.testing", "--port", "0", "--http-threads", "2"]
    command = parse_server_command(argv, {})
    assert (command.kind, command.base_http_threads(64), command.build_info) == ("emulator", 2, "b11434-emulated")
    fixed = parse_server_command([*argv, "--fixed-pool"], {})
    assert fixed.build_info == "b11737-emulated"
    assert parse_server_command([sys.executable, "-m", "llama_guard.testing"], {}).base_http_threads(64) == 4


def test_other_processes_are_not_servers():
    command = parse_server_command(["python3", "app.py", "--port", "80"], {"LLAMA_ARG_PORT": "1"})
    assert command.kind == "other"
    assert command.base_http_threads(8) is None
    assert command.port == Setting(None, "unknown")


@pytest.mark.parametrize(
    ("argv", "exe", "expected"),
    [
        (["llama-server"], None, True),
        (["/usr/local/bin/llama-server", "-m", "x"], "/usr/local/bin/llama-server", True),
        (["server"], "/opt/llama.cpp/build/bin/llama-server (deleted)", True),
        (["python3", "llama-server"], "/usr/bin/python3.11", False),
        (["llama-server-wrapper.sh"], "/bin/bash", False),
    ],
)
def test_llama_server_is_found_by_its_executables_name(argv, exe, expected):
    assert is_llama_server(argv, exe) is expected


@pytest.mark.parametrize(
    ("info", "number"),
    [("b11434-1a2b3c4d", 11434), ("b0-unknown", None), ("b11737", 11737), (None, None), ("", None), ("v1.2", None)],
)
def test_build_numbers(info, number):
    assert build_number(info) == number


@pytest.mark.parametrize(("number", "defect"), [(11434, True), (11736, True), (11737, False), (12000, False)])
def test_the_pool_defect_by_build(number, defect):
    assert has_pool_defect(number) is defect
    assert has_pool_defect(None) is None


@pytest.mark.parametrize(
    ("info", "defect"),
    [
        ("b11434-fixedpool", False),  # get_llama_server.py --fixed-pool: b11434 with the fix applied
        (" b11434-fixedpool\n", False),
        ("b11434-1a2b3c4d", True),
        ("b11434-fixedpool2", True),
        ("fixedpool", None),
        ("b0-unknown", None),
        (None, None),
        ("b11800-abc", False),
    ],
)
def test_a_patched_build_has_the_fixed_pool(info, defect):
    assert build_has_pool_defect(info) is defect


def test_version_output_of_the_patched_build_is_read_as_fixed():
    # What `llama-server --version` prints for the build made with -DLLAMA_BUILD_COMMIT=fixedpool.
    info = version_build_info("version: 0.6.0-dev (build 11434, commit fixedpool)\nbuilt with GNU 12.2.0\n")
    assert info == "b11434-fixedpool"
    assert build_has_pool_defect(info) is False


@pytest.mark.parametrize(
    ("output", "build"),
    [
        ("version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0 for Linux x86_64\n", "b0-unknown"),
        ("version: 0.7.1 (build 11800, commit 9f8e7d6c)\nbuilt with cc for x\n", "b11800-9f8e7d6c"),
        ("version: 4589 (1d1e6a90)\nbuilt with cc (GCC) 13.2.0 for x86_64-linux-gnu\n", "b4589-1d1e6a90"),
        ("error: unknown argument: --version\n", None),
    ],
)
def test_version_output(output, build):
    assert version_build_info(output) == build


# -- the stall tracker ---------------------------------------------------------------------------------------------

A = ConnectionKey(Endpoint("127.0.0.1", 8080), Endpoint("127.0.0.1", 50001))
B = ConnectionKey(Endpoint("127.0.0.1", 8080), Endpoint("127.0.0.1", 50002))


def _feed(tracker, steps):
    """steps: (time, {key: (rx_queue, state)}) -> the events as (time, kind, key, seconds)."""
    seen = []
    for now, table in steps:
        samples = {key: QueueSample(rx, state) for key, (rx, state) in table.items()}
        seen += [(now, e.kind, e.key, round(e.seconds, 3), e.client_gave_up) for e in tracker.update(now, samples)]
    return seen


E, CW = ESTABLISHED, CLOSE_WAIT


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        pytest.param(
            [(t, {A: (38, E)}) for t in range(7)],
            [(5, "stalled", A, 5.0, False)],
            id="unread for the threshold: one report, at the threshold",
        ),
        pytest.param(
            [(0, {A: (38, E)}), (1, {A: (0, E)}), (2, {A: (38, E)}), (3, {A: (0, E)}), (4, {A: (38, E)})]
            + [(t, {A: (38, E)}) for t in (5, 6, 7, 8, 9)],
            [(9, "stalled", A, 5.0, False)],
            id="a busy connection that gets read starts over each time",
        ),
        pytest.param(
            [(t, {A: (38, E)}) for t in range(6)] + [(6, {A: (0, E)})],
            [(5, "stalled", A, 5.0, False), (6, "read", A, 6.0, False)],
            id="read at last",
        ),
        pytest.param(
            [(t, {A: (38, E)}) for t in range(6)] + [(6, {A: (38, CW)}), (7, {})],
            [(5, "stalled", A, 5.0, False), (7, "closed", A, 7.0, True)],
            id="the client gives up, then the connection goes",
        ),
        pytest.param(
            [(0, {A: (38, E)}), (2, {A: (76, E)}), (5, {A: (76, E)})],
            [(5, "stalled", A, 5.0, False)],
            id="a second request behind the first: still unread",
        ),
        pytest.param(
            [(0, {A: (76, E)}), (2, {A: (38, E)}), (6, {A: (38, E)}), (7, {A: (38, E)})],
            [(7, "stalled", A, 5.0, False)],
            id="a shrinking queue was read: the clock restarts",
        ),
        pytest.param(
            [
                (0, {A: (38, E), B: (0, E)}),
                (3, {A: (38, E), B: (10, E)}),
                (5, {A: (38, E), B: (10, E)}),
                (8, {A: (38, E), B: (10, E)}),
            ],
            [(5, "stalled", A, 5.0, False), (8, "stalled", B, 5.0, False)],
            id="each connection has its own clock",
        ),
        pytest.param(
            [(0, {A: (38, E)}), (4, {})],
            [],
            id="closed before the threshold: nothing to say",
        ),
    ],
)
def test_stall_tracking(steps, expected):
    tracker = StallTracker(threshold=5.0)
    assert _feed(tracker, steps) == expected


def test_the_tracker_remembers_the_longest_wait():
    tracker = StallTracker(threshold=2.0)
    _feed(tracker, [(t, {A: (38, E)}) for t in range(10)])
    assert tracker.stalled == {A: 9.0}
    assert tracker.unread_now() == {A: 0}
    with pytest.raises(ValueError, match="threshold must be > 0"):
        StallTracker(threshold=0)


def test_event_lines():
    assert event_line(StallEvent("stalled", A, 38.2)) == (
        "STALLED 127.0.0.1:8080<-127.0.0.1:50001: request unread for 38 s"
    )
    assert event_line(StallEvent("read", A, 12.0)).startswith("SERVED 127.0.0.1:8080<-127.0.0.1:50001")
    six = ConnectionKey(Endpoint("::1", 8080), Endpoint("::1", 50001))
    assert "gave up" in event_line(StallEvent("closed", six, 9.0, client_gave_up=True))
    assert str(six) == "[::1]:8080<-[::1]:50001"


# -- the risk rule --------------------------------------------------------------------------------------------------


def _view(build, threads="2"):
    command = parse_server_command(["llama-server", "--threads-http", threads], {})
    return ServerView(4242, command, (Endpoint("127.0.0.1", 8080),), build, "--version")


@pytest.mark.parametrize(
    ("build", "connections", "risk"),
    [
        ("b11434-1a2b", 3, "risk"),
        ("b11434-1a2b", 2, "ok"),
        ("b11737-1a2b", 30, "ok"),
        ("b0-unknown", 3, "possible"),
        (None, 3, "possible"),
        (None, 1, "ok"),
    ],
)
def test_risk(build, connections, risk):
    assessment = assess(_view(build), connections, cpus=2)
    assert assessment.risk == risk
    assert assessment.base_threads == 2
    if risk == "risk":
        assert "upgrade llama-server to b11737" in assessment.message


def test_risk_is_unknown_without_settings():
    view = ServerView(None, None, (Endpoint("0.0.0.0", 8080),), None, "process not readable")
    assert assess(view, 50, cpus=2).risk == "unknown"


# -- against a fake /proc: discovery without a server ----------------------------------------------------------------


def _fake_proc(tmp_path: Path, *, exe_script: str | None = None) -> Path:
    """A /proc with one llama-server (pid 4242, one base HTTP thread) listening on 127.0.0.1:8080, with two
    established client connections and one whose client gave up."""
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text(
        TABLE + "   4: 0100007F:1F90 0100007F:D3B0 01 00000000:00000000 00:00000000 00000000  1000        0 482914 1\n"
    )
    fds = proc / "4242" / "fd"
    fds.mkdir(parents=True)
    for number, inode in enumerate((482900, 482913, 482914)):
        os.symlink(f"socket:[{inode}]", fds / str(number))
    os.symlink("/dev/null", fds / "9")
    (proc / "4242" / "cmdline").write_bytes(b"llama-server\0--threads-http\0001\0--api-key\0s3cret\0")
    (proc / "4242" / "environ").write_bytes(b"LLAMA_ARG_N_PARALLEL=2\0OPENAI_API_KEY=sk-nope\0")
    if exe_script is not None:
        exe = tmp_path / "bin" / "llama-server"
        exe.parent.mkdir()
        exe.write_text(exe_script)
        exe.chmod(0o755)
        os.symlink(exe, proc / "4242" / "exe")
    (proc / "77").mkdir()
    (proc / "77" / "cmdline").write_bytes(b"bash\0")
    return proc


def test_watch_finds_a_llama_server_and_flags_it_by_its_version(tmp_path):
    script = "#!/bin/sh\necho 'version: 0.5.0 (build 11434, commit 1a2b3c4d)' >&2\n"
    proc = _fake_proc(tmp_path, exe_script=script)
    out, err = io.StringIO(), io.StringIO()
    code = run_watch(WatchOptions(proc=proc), out=out, err=err)
    text = out.getvalue()
    assert code == 1, text + err.getvalue()
    assert "llama-server pid 4242 on 127.0.0.1:8080" in text
    assert "b11434-1a2b3c4d (from --version): has the pool defect" in text
    # The CLOSE_WAIT one is counted apart: the unread ones never outnumber the connections they are counted in.
    assert (
        "client connections: 2 established, 1 of them with request bytes unread right now; "
        "1 more closed by their client (CLOSE-WAIT), 1 of them with request bytes unread"
    ) in text
    assert "RISK" in text
    assert "s3cret" not in text  # its command line holds a key: never printed


def test_watch_json_from_a_fake_proc(tmp_path):
    proc = _fake_proc(tmp_path, exe_script="#!/bin/sh\necho 'version: 0.6.0-dev (build 0, commit unknown)'\n")
    out = io.StringIO()
    assert run_watch(WatchOptions(proc=proc, json=True), out=out, err=io.StringIO()) == 0
    document = json.loads(out.getvalue())
    assert document["exit_code"] == 0
    assert document["watch"] is None
    (server,) = document["servers"]
    assert server["pid"] == 4242
    assert server["build_info"] == "b0-unknown"
    assert server["build_number"] is None
    assert server["base_http_threads"] == 1
    assert server["parallel"] == 2  # from LLAMA_ARG_N_PARALLEL
    assert server["connections"] == 2
    assert (server["unread_now"], server["established_unread_now"]) == (2, 1)
    assert (server["close_wait_now"], server["close_wait_unread_now"]) == (1, 1)
    assert server["risk"] == "possible"  # more connections than threads, but the build does not say: exit 0
    assert "s3cret" not in out.getvalue()
    assert "sk-nope" not in out.getvalue()


def test_watch_without_a_server_is_a_clear_error(tmp_path):
    proc = _fake_proc(tmp_path)
    (proc / "4242" / "cmdline").write_bytes(b"nginx\0")
    out, err = io.StringIO(), io.StringIO()
    assert run_watch(WatchOptions(proc=proc), out=out, err=err) == 2
    assert err.getvalue().startswith("llama-guard watch: no running llama-server found")
    assert err.getvalue().count("\n") == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pids": (999999999,)}, "no process with pid 999999999"),
        ({"ports": (1,)}, "nothing listens on TCP port 1"),
    ],
)
def test_watch_bad_targets_are_one_line_errors(options, message, capsys):
    assert run_watch(WatchOptions(**options)) == 2
    captured = capsys.readouterr()
    assert captured.err == f"llama-guard watch: {message}\n"


def test_watch_without_proc_net_tcp(tmp_path, capsys):
    assert run_watch(WatchOptions(proc=tmp_path)) == 2
    assert capsys.readouterr().err.startswith(f"llama-guard watch: cannot read {tmp_path}/net/tcp")


def test_a_watch_shorter_than_the_stall_threshold_says_so_and_does_not_hint_at_watching(tmp_path):
    proc = _fake_proc(tmp_path)  # no readable executable: the build is unknown, 2 connections > 1 base thread
    out = io.StringIO()
    assert run_watch(WatchOptions(proc=proc), out=out, err=io.StringIO()) == 0
    assert "(watch with --watch SECONDS to see stalls)" in out.getvalue()  # one look: watching is the next step
    out, err = io.StringIO(), io.StringIO()
    code = run_watch(WatchOptions(proc=proc, seconds=1, interval=0.5, stall_seconds=5), out=out, err=err)
    lines = out.getvalue().splitlines()
    assert code == 0, lines
    assert "--watch SECONDS" not in out.getvalue()  # it is watching already
    assert (
        "llama-guard watch: note: --watch 1 s is shorter than --stall-seconds 5 s: no stall can be seen in this "
        "watch, only the connection counts"
    ) in err.getvalue().splitlines()
    assert lines[-2].startswith(
        "llama-server pid 4242 on 127.0.0.1:8080: possible risk: up to 2 client connections during the watch > 1 base"
    )
    assert lines[-1] == "no stalled connection in 1 s (too short to see one: a stall takes --stall-seconds 5 s)"


def test_the_docs_list_every_exit_status_of_watch_help():
    tail = WATCH_DESCRIPTION.partition("exit status:")[2]
    in_help = re.findall(r"(?:: |, |\n)(\d+) [a-z]", ": " + tail.lstrip())
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    section = docs.partition("\n## watch\n")[2].partition("\n## ")[0]
    table = section.partition("\n### Exit status\n")[2].partition("\n### ")[0]
    assert in_help == ["0", "1", "2", "130"]
    assert re.findall(r"^\| (\d+) \|", table, re.MULTILINE) == in_help


# -- end to end: the emulator as a process ---------------------------------------------------------------------------


@dataclass
class Emulator:
    process: subprocess.Popen[str]
    port: int


@contextlib.contextmanager
def emulator_process(*args: str) -> Iterator[Emulator]:
    """``python -m llama_guard.testing --port 0 ARGS`` in its own process; stopped (and reaped) at the end."""
    command = [sys.executable, "-m", "llama_guard.testing", "--port", "0", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 20)
        line = process.stdout.readline() if ready else ""
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert match, f"the emulator did not start: {line!r}"
        yield Emulator(process, int(match.group(1)))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


@dataclass
class Watcher:
    """``llama-guard watch`` as a process, its output lines timed as they come (since the process started)."""

    process: subprocess.Popen[str]
    started: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=5)
        return code

    def start_reading(self) -> None:
        def read(stream: io.TextIOBase | None, into: list[tuple[float, str]]) -> None:
            assert stream is not None
            for line in stream:
                into.append((time.monotonic() - self.started, line.rstrip("\n")))

        for stream, into in ((self.process.stdout, self.lines), (self.process.stderr, self.errors)):
            self.readers.append(threading.Thread(target=read, args=(stream, into), daemon=True))
            self.readers[-1].start()

    @property
    def watching_since(self) -> float:
        """When it began to sample (its "watching ..." line): the interpreter's start-up is not watch's delay,
        and on a busy 2-core machine it can take seconds."""
        return next(at for at, line in self.errors if line.startswith("watching "))


@contextlib.contextmanager
def watcher(*args: str) -> Iterator[Watcher]:
    """``python -m llama_guard watch ARGS``; killed (if still running) and reaped at the end."""
    command = [sys.executable, "-m", "llama_guard", "watch", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running = Watcher(process, time.monotonic())
    running.start_reading()
    try:
        yield running
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for reader in running.readers:
            reader.join(timeout=5)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _answered(socks: list[socket.socket], within: float, want: int | None = None) -> list[bool]:
    """Which sockets have a response waiting: once ``want`` (default: all) have one, or after ``within`` s."""
    deadline = time.monotonic() + within
    answered = [False] * len(socks)
    want = len(socks) if want is None else want
    while True:
        readable, _, _ = select.select([s for s, a in zip(socks, answered, strict=True) if not a], [], [], 0.05)
        for sock in readable:
            answered[socks.index(sock)] = True
        if sum(answered) >= want or time.monotonic() >= deadline:
            return answered


@contextlib.contextmanager
def burst(port: int, count: int) -> Iterator[list[socket.socket]]:
    socks = open_burst("127.0.0.1", port, count)
    try:
        for sock in socks:
            sock.sendall(HEALTH)
        yield socks
    finally:
        for sock in socks:
            sock.close()


# The emulator's served connections are held by their threads for the keep-alive timeout; a long one stands for
# busy clients, so the queued connections stay unread for the whole test (as with a real pool in use).
BUGGY = ("--http-threads", "2", "--keepalive-timeout", "60", "--stall-burst", "6")
# The same pool with the fix: threads are started as the burst needs them (no stall mode: it models the bug).
FIXED = ("--http-threads", "2", "--keepalive-timeout", "60", "--fixed-pool")
#: How long the burst's answers may take to come: the wait ends when they have, so it is generous for a loaded machine.
ANSWER_WAIT = 30.0


@pytest.mark.slow  # watches for 10 s
def test_watch_reports_a_stalled_connection_within_10_seconds():
    with emulator_process(*BUGGY) as server, burst(server.port, 6) as socks:
        # The 2 pool threads serve 2 (the wait ends as soon as they have); the defect (deterministic: --stall-burst)
        # leaves the other 4 unread for as long as the served ones stay open.
        answered = _answered(socks, within=ANSWER_WAIT, want=2)
        unread = {sock.getsockname()[1] for sock, done in zip(socks, answered, strict=True) if not done}
        assert len(unread) == 4, answered
        with watcher("--port", str(server.port), "--watch", "10") as running:
            code = running.finish(timeout=25)
        stalled = [(at - running.watching_since, line) for at, line in running.lines if line.startswith("STALLED")]
        reported = {int(re.search(r"<-127\.0\.0\.1:(\d+):", line).group(1)) for _, line in stalled}
        assert reported == unread, running.lines
        for _, line in stalled:
            # Found within 10 s of starting to watch, by watch's own clock (the unread time it reports counts from
            # its first sample): at least the 5 s threshold, more when a loaded machine delays a sample.
            assert re.fullmatch(
                rf"STALLED 127\.0\.0\.1:{server.port}<-127\.0\.0\.1:\d+: request unread for [5-9] s", line
            )
        assert code == 1
        assert any("4 stalled connection(s)" in line for _, line in running.lines)


@pytest.mark.slow  # watches for 3 s in a subprocess
def test_watch_is_quiet_and_exits_0_on_a_fixed_pool():
    with emulator_process(*FIXED) as server, burst(server.port, 6) as socks:
        assert all(_answered(socks, within=ANSWER_WAIT))  # the fixed pool starts the threads the burst needs
        for sock in socks:
            sock.sendall(HEALTH)  # and keeps serving: a second request on each, answered, leaves nothing unread
        with watcher("--port", str(server.port), "--watch", "3", "--stall-seconds", "1") as running:
            code = running.finish(timeout=20)
        text = "\n".join(line for _, line in running.lines)
        assert code == 0, text
        assert "STALLED" not in text
        assert "6 established" in text
        assert "has the fixed pool" in text
        assert text.endswith("no stalled connection in 3 s")  # 3 s is long enough for a 1 s stall: no note
        assert not [line for _, line in running.errors if "note:" in line]


def test_watch_flags_the_risk_by_pid_in_one_look():
    with emulator_process(*BUGGY) as server, burst(server.port, 3):
        out = io.StringIO()
        deadline = time.monotonic() + 5
        while True:  # the burst's connections are established at once; the server side shows them as soon as
            out = io.StringIO()
            code = run_watch(WatchOptions(pids=(server.process.pid,), json=True), out=out, err=io.StringIO())
            (found,) = json.loads(out.getvalue())["servers"]
            if found["connections"] == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert code == 1
        assert found["kind"] == "emulator"
        assert found["listen"] == [f"127.0.0.1:{server.port}"]
        assert (found["base_http_threads"], found["connections"], found["risk"]) == (2, 3, "risk")
        assert found["build_has_pool_defect"] is True


def test_watch_command_line_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["watch", "--port", "70000"])
    assert info.value.code == 2
    assert (
        "argument --port: expected a TCP port, a whole number from 1 to 65535, got '70000'" in capsys.readouterr().err
    )


def _wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {within:g} s"
        time.sleep(0.01)


def _server_side(port: int) -> list[tuple[int, int]]:
    """(state, unread bytes) of every connection on the server side of ``port``, sorted."""
    return sorted((row.state, row.rx_queue) for row in read_sockets(Path("/proc")) if row.local.port == port)


@pytest.mark.slow  # watches for 6 s in a subprocess
def test_a_watch_ends_with_the_verdict_of_its_exit_status():
    """The first look finds no connection ("ok"); 6 opened while watch samples are a risk on 2 base threads. The
    exit status is 1 for them, so the last lines must say so (they said "ok" and "no stalled connection")."""
    with emulator_process("--http-threads", "2", "--keepalive-timeout", "60") as server:
        # 6 s of samples 0.2 s apart: the burst opens milliseconds after the watching line, so it is sampled
        # unless this process is kept off the CPU for most of the watch.
        args = ("--port", str(server.port), "--watch", "6", "--interval", "0.2", "--stall-seconds", "30")
        with watcher(*args) as running:
            _wait_for(lambda: any(line.startswith("watching ") for _, line in running.errors), 30, "watching line")
            with burst(server.port, 6):
                code = running.finish(timeout=30)
    lines = [line for _, line in running.lines]
    assert "  ok: 0 client connections <= 2 base HTTP threads" in lines  # the first look, before the burst
    assert code == 1, lines
    assert re.fullmatch(
        rf"emulator pid \d+ on 127\.0\.0\.1:{server.port}: RISK: build b11434 \(before b11737\) with up to 6 client "
        r"connections during the watch > 2 base HTTP threads: .*",
        lines[-2],
    ), lines
    assert lines[-1] == (
        "no stalled connection in 6 s (too short to see one: a stall takes --stall-seconds 30 s), "
        "but 1 server(s) at RISK (above)"
    )


def test_one_look_at_several_servers_ends_with_how_many_are_at_risk():
    with emulator_process(*BUGGY) as server, burst(server.port, 3), socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        _wait_for(lambda: len(_server_side(server.port)) == 4, 5, "3 connections and the listener in /proc")
        out = io.StringIO()
        code = run_watch(WatchOptions(ports=(server.port, other.getsockname()[1])), out=out, err=io.StringIO())
    lines = out.getvalue().splitlines()
    assert code == 1, lines
    assert "  RISK: build b11434 (before b11737) with 3 client connections > 2 base HTTP threads" in lines[4]
    assert lines[-1] == "2 servers, 1 at RISK"  # not the last server's own "0 client connections"


@contextlib.contextmanager
def _queued_connections() -> Iterator[int]:
    """A listener on loopback that never accepts, holding 2 idle connections, 1 with a request, 3 whose clients
    sent a request and closed (CLOSE-WAIT, unread), and 1 whose client closed without sending anything. Yields its
    port once ``/proc`` shows them all so."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        clients = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5)) for _ in range(7)]
        for client in clients[2:6]:
            client.sendall(HEALTH)
        for client in clients[3:]:
            client.close()
        # Recv-Q counts the FIN of a CLOSE-WAIT socket as a byte until the process reads the end of the stream.
        closed = [(CLOSE_WAIT, len(HEALTH) + 1)] * 3 + [(CLOSE_WAIT, 1)]
        expected = sorted([(ESTABLISHED, 0)] * 2 + [(ESTABLISHED, len(HEALTH))] + closed + [(LISTEN, 7)])
        _wait_for(lambda: _server_side(port) == expected, 5, f"connections in their states: {expected}")
        yield port


def test_connections_closed_by_their_client_are_counted_apart():
    """A request left unread in a connection its client closed stays in the server's socket (CLOSE-WAIT): counted
    with the established ones, "0 established, 3 with request bytes unread" read as a contradiction. A closed one
    that holds no request (only the FIN) is not unread."""
    with _queued_connections() as port:
        out = io.StringIO()
        assert run_watch(WatchOptions(ports=(port,)), out=out, err=io.StringIO()) == 0
        assert (
            "  client connections: 3 established, 1 of them with request bytes unread right now; "
            "4 more closed by their client (CLOSE-WAIT), 3 of them with request bytes unread"
        ) in out.getvalue().splitlines()
        out = io.StringIO()
        assert run_watch(WatchOptions(ports=(port,), json=True), out=out, err=io.StringIO()) == 0
    (server,) = json.loads(out.getvalue())["servers"]
    assert (server["connections"], server["unread_now"]) == (3, 4)  # as before: established; unread of either
    assert (server["established_unread_now"], server["close_wait_now"], server["close_wait_unread_now"]) == (1, 4, 3)


def test_a_connection_closed_without_a_request_is_no_stall():
    """Its Recv-Q stays 1 (the FIN) until the server reads the end of the stream: that is no request unread."""
    with _queued_connections() as port:
        out = io.StringIO()
        options = WatchOptions(ports=(port,), seconds=1.0, interval=0.25, stall_seconds=0.5, json=True)
        assert run_watch(options, out=out, err=io.StringIO()) == 1
    stalled = json.loads(out.getvalue())["watch"]["stalled"]
    assert len(stalled) == 4, stalled  # the connection with a request and the 3 closed after sending theirs


def test_a_server_asked_for_twice_is_reported_once():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for options in (WatchOptions(ports=(port, port)), WatchOptions(pids=(os.getpid(),), ports=(port,))):
            out = io.StringIO()
            assert run_watch(replace(options, json=True), out=out, err=io.StringIO()) == 0
            (server,) = json.loads(out.getvalue())["servers"]
            assert server["pid"] == os.getpid()
            assert f"127.0.0.1:{port}" in server["listen"]
