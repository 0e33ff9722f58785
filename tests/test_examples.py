"""Every example runs as a user would run it (``python examples/X.py``), against the emulator it starts itself,
and exits 0 only when the guard lost nothing. The FastAPI proxy has its own tests (test_fastapi_proxy.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STANDALONE = sorted(
    p.name for p in EXAMPLES.glob("*.py") if p.name != "fastapi_proxy.py" and not p.name.startswith("_")
)


def test_every_example_is_covered() -> None:
    assert {"plain_httpx.py", "async_httpx.py", "existing_client.py", "openai_sdk.py", "httpx2_client.py"} <= set(
        STANDALONE
    )


@pytest.mark.slow  # an interpreter per example, 2 to 9 s each
@pytest.mark.parametrize("name", STANDALONE)
def test_example_runs(name: str) -> None:
    process = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120, check=False
    )
    assert process.returncode == 0, process.stdout + process.stderr
    assert "Traceback" not in process.stderr
