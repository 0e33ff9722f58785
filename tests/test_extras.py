"""Without the optional extras: every public entry point works, and a flavour that needs an extra names it.

aiohttp and httpx2 are installed here, so a fresh interpreter hides them (``sys.modules[name] = None`` makes their
import fail as if they were missing). CI also runs ``scripts/smoke_no_extras.py`` in a venv that truly lacks them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from llama_guard._core.extras import missing_extra
from llama_guard.testing import LlamaServerEmulator

TIMEOUT = 60

HIDE = "import sys\nfor _name in ('aiohttp', 'httpx2', 'httpcore2'):\n    sys.modules[_name] = None\n"


def run_without_extras(body: str, *args: str) -> dict[str, object]:
    script = HIDE + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_install_uninstall_and_guard_need_no_extra() -> None:
    """install() -> a guarded request -> uninstall(), then guard(): no aiohttp or httpx2 imported or needed."""
    with LlamaServerEmulator() as server:
        result = run_without_extras(
            """
            import json, httpx, llama_guard
            url = sys.argv[1]
            llama_guard.install(origins=[url])
            with httpx.Client(base_url=url) as client:
                installed = "llama_guard" in client.get("/health").extensions
                llama_guard.uninstall()
                after = "llama_guard" in client.get("/health").extensions
            with llama_guard.guard(httpx.Client(base_url=url)) as client:
                guarded = "llama_guard" in client.get("/health").extensions
            print(json.dumps({"installed": installed, "after": after, "guarded": guarded}))
            """,
            server.url,
        )
    assert result == {"installed": True, "after": False, "guarded": True}


@pytest.mark.parametrize(("flavour", "extra"), [("aiohttp", "aiohttp"), ("httpx2", "httpx2")])
def test_a_missing_extra_is_named_when_its_flavour_is_imported(flavour: str, extra: str) -> None:
    result = run_without_extras(
        f"""
        import json
        try:
            import llama_guard.{flavour}
        except ModuleNotFoundError as exc:
            print(json.dumps({{"error": str(exc)}}))
        else:
            print(json.dumps({{"error": None}}))
        """
    )
    error = str(result["error"])
    assert f"llama_guard.{flavour} needs" in error
    assert f"pip install 'llama-guard[{extra}]'" in error
    assert f"pip install -e '.[{extra}]'" in error


def test_another_missing_module_is_not_blamed_on_the_extra() -> None:
    """A dependency of the extra's library that is missing is a broken install: the original error, unchanged."""
    original = ModuleNotFoundError("No module named 'multidict'", name="multidict")
    with pytest.raises(ModuleNotFoundError) as info:
        missing_extra(original, feature="llama_guard.aiohttp", extra="aiohttp", modules=("aiohttp",))
    assert info.value is original
    with pytest.raises(ModuleNotFoundError, match=r"llama-guard\[aiohttp\]") as info:
        missing_extra(
            ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp"),
            feature="llama_guard.aiohttp",
            extra="aiohttp",
            modules=("aiohttp",),
        )
    assert info.value.name == "aiohttp"
