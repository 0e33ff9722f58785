"""The package's layout rules: private httpcore/httpx/aiohttp attributes are touched only by the internals modules,
``llama_guard._core`` imports no HTTP library, and log messages carry no ``llama_guard:`` prefix."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpcore
import httpx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llama_guard"
# The only modules allowed to touch private attributes of the HTTP libraries (the second is generated).
INTERNALS = {
    PACKAGE / "_httpx" / "internals.py",
    PACKAGE / "_httpx2" / "internals.py",
    PACKAGE / "_aiohttp" / "internals.py",
    PACKAGE / "_requests" / "internals.py",
}
HTTP_LIBRARIES = ("httpx", "httpcore", "httpx2", "httpcore2", "aiohttp", "urllib3", "requests")
_ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines itself: functions, classes, ``self._x`` attributes, slots, class fields."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # __slots__ entries, namespace dict keys
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if _private(name)}


def _imported_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> module, for ``import x`` and ``import x as y``."""
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.partition(".")[0]] = alias.name
    return modules


def private_accesses(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every access to a private attribute that is not the code's own.

    Allowed: ``self._x``/``cls._x``; ``module._x`` of an imported module that is not an HTTP library (``os._exit``);
    ``obj._x`` where this module defines ``_x`` itself, unless an HTTP library's objects have an ``_x`` too (then the
    name alone cannot tell whose attribute it is).
    """
    tree = ast.parse(source)
    own = _own_private_names(tree) - LIBRARY_PRIVATE_NAMES
    modules = _imported_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            base, name = node.args[0], node.args[1].value
        else:
            continue
        if isinstance(base, ast.Name):
            if base.id in ("self", "cls"):
                continue
            module = modules.get(base.id)
            if module is not None and module.partition(".")[0] not in HTTP_LIBRARIES:
                continue
        if name in own:
            continue
        yield node.lineno, ast.unparse(node)


def _library_private_names() -> set[str]:
    """Private attribute names of the HTTP libraries' classes and of the objects a guard meets."""
    names: set[str] = set()
    libraries = [httpx, httpcore]
    for optional in ("httpx2", "httpcore2", "aiohttp"):
        with contextlib.suppress(ImportError):  # the dev install has them
            libraries.append(__import__(optional))
    for library in libraries:
        prefix = library.__name__ + "."
        for module_name, module in list(sys.modules.items()):
            if module_name != library.__name__ and not module_name.startswith(prefix):
                continue
            for value in vars(module).values():
                if isinstance(value, type):
                    names.update(name for klass in value.__mro__ for name in vars(klass) if _private(name))
        if not hasattr(library, "Client"):
            continue  # httpcore: its pool is sampled through httpx's transport below
        with library.Client() as client:
            transport = client._transport
            samples = [client, transport, transport._pool, library.Headers({"a": "b"})]
            samples += [library.Request("GET", "http://a/"), library.Response(200)]
            for sample in samples:
                names.update(name for name in vars(sample) if _private(name))
    return names


def _aiohttp_private_names() -> set[str]:
    """Private attributes of the aiohttp objects a guard meets (set in their constructors, so not in the classes)."""
    try:
        import aiohttp
    except ImportError:
        return set()

    async def sample() -> set[str]:
        connector = aiohttp.TCPConnector()
        async with aiohttp.ClientSession(connector=connector) as session:
            return {name for obj in (session, connector) for name in vars(obj) if _private(name)}

    return asyncio.run(sample())


LIBRARY_PRIVATE_NAMES = _library_private_names() | _aiohttp_private_names()


def _package_files() -> list[Path]:
    # testing/ is the emulator and its client helpers, not the guard: it may build pools its own way.
    return sorted(p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts)


def test_no_private_http_library_access_outside_the_internals_modules() -> None:
    """A new httpcore/httpx release can break private attributes: they are reached from the internals module only."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in _package_files()
        if path not in INTERNALS
        for line, text in private_accesses(path.read_text())
    ]
    assert found == []


def test_the_private_access_check_can_fail() -> None:
    """The checker flags reaches into httpcore/httpx objects, and lets the code's own privates be."""
    flagged = [
        "pool._network_backend = backend",
        "getattr(transport, '_pool', None)",
        "client._mounts.items()",
        "headers._list",
        "run.guard._probe(stream)",
        "import httpcore\nhttpcore._async.http11",
        "connector._conns.get(key)",
        "session._retry_connection = False",
        "import aiohttp\naiohttp._http_parser",
    ]
    for source in flagged:
        assert list(private_accesses(source)), source
    allowed = [
        "self._pool = None",
        "import os\nos._exit(2)",
        "class A:\n    def _covers(self): ...\ndef f(a): return a._covers()",
    ]
    for source in allowed:
        assert list(private_accesses(source)) == [], source
    # An own name that httpx uses too is no excuse: ``_transport`` is httpx.Client's.
    assert list(private_accesses("class A:\n    def __init__(self): self._transport = 1\ndef f(c): c._transport"))


def test_core_imports_no_http_library() -> None:
    """``llama_guard._core`` is free of httpx/httpcore: checked on its imports and in a fresh interpreter."""
    core = PACKAGE / "_core"
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
                if node.level >= 2 or (node.level == 1 and node.module is None):
                    names = []
                assert node.level <= 1, f"{path.name} imports from outside _core: {ast.unparse(node)}"
            else:
                continue
            assert not [n for n in names if n.partition(".")[0] in HTTP_LIBRARIES], f"{path.name}: {ast.unparse(node)}"
    # The package's own __init__ imports the transports: stand in an empty package so that only _core loads.
    code = (
        "import sys, types, importlib, pkgutil\n"
        "package = types.ModuleType('llama_guard'); package.__path__ = [sys.argv[1]]\n"
        "sys.modules['llama_guard'] = package\n"
        "core = importlib.import_module('llama_guard._core')\n"
        "for m in pkgutil.iter_modules(core.__path__): importlib.import_module('llama_guard._core.' + m.name)\n"
        "assert len([n for n in sys.modules if n.startswith('llama_guard._core.')]) >= 10\n"
        f"print(sorted(n for n in sys.modules if n.partition('.')[0] in {HTTP_LIBRARIES!r}))\n"
    )
    command = [sys.executable, "-c", code, str(PACKAGE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("module", ["llama_guard._cli.doctor.command", "llama_guard._cli.watch.command"])
def test_commands_that_do_not_run_the_emulator_do_not_import_it(module: str) -> None:
    """The CLI reaches ``llama_guard.testing`` (the emulator, the largest room) only where it runs it: the demo.
    Checked in a fresh interpreter; the control is the demo's module, which must import it."""
    code = (
        "import importlib, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        "print(sorted(n for n in sys.modules if n.startswith('llama_guard.testing')))\n"
    )
    for name, imports_testing in ((module, False), ("llama_guard._cli.demo", True)):
        result = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
        assert (result.stdout.strip() != "[]") is imports_testing, (name, result.stdout)


_LOG_METHODS = ("debug", "info", "warning", "error", "exception")


def prefixed_log_messages(source: str) -> Iterator[tuple[int, str]]:
    """Log calls (``logger.warning(...)``, ``warnings.warning(...)``) whose message starts with ``llama_guard:``:
    the logger's name says where a record comes from (docs/configuration.md, "Logging")."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        if node.func.attr not in _LOG_METHODS:
            continue
        message = node.args[0]
        head = message.values[0] if isinstance(message, ast.JoinedStr) and message.values else message
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith("llama_guard:"):
            yield node.lineno, head.value


def test_log_messages_carry_no_prefix() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in _package_files()
        for line, text in prefixed_log_messages(path.read_text())
    ]
    assert found == []
    # The check can fail: plain and f-string messages, on a logger or on the warn-once set.
    assert len(list(prefixed_log_messages('logger.info("llama_guard: x %s", 1)\nw.warning(f"llama_guard: {y}")'))) == 2
    assert list(prefixed_log_messages('logger.info("connections to %s", o)')) == []
