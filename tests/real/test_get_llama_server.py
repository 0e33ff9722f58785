"""scripts/get_llama_server.py: the fast paths and the one-line failures (no build here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "get_llama_server.py"


def run(env: dict[str, str], *, path: str | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER_BIN"}
    full.update(env)
    if path is not None:
        full["PATH"] = path
    return subprocess.run(
        [sys.executable, str(SCRIPT)], env=full, capture_output=True, text=True, timeout=120, check=False
    )


def test_llama_server_bin_is_used_as_is(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    done = run({"LLAMA_SERVER_BIN": str(fake)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(fake.resolve())


def test_llama_server_bin_not_executable_fails_in_one_line(tmp_path):
    done = run({"LLAMA_SERVER_BIN": str(tmp_path / "missing")})
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("error: LLAMA_SERVER_BIN=")
    assert len(done.stderr.strip().splitlines()) == 1


def test_missing_cmake_fails_in_one_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()  # a PATH with no cmake and no compiler
    done = run({"LLAMA_GUARD_CACHE": str(tmp_path / "cache")}, path=str(bin_dir))
    assert done.returncode == 2
    assert done.stderr.strip() == "error: cmake not found on PATH (install cmake >= 3.18, e.g. apt-get install cmake)"


@pytest.mark.real_server
def test_cached_binary_is_found_instantly(llama_server_bin):
    if os.environ.get("LLAMA_SERVER_BIN"):
        pytest.skip("LLAMA_SERVER_BIN is set; the cache is not used")
    done = run({})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.splitlines()[-1]) == llama_server_bin
    assert done.stderr == ""  # nothing to do, nothing to say
