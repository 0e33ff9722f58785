"""The API reference page (docs/api.md, mkdocstrings) as a reader sees it: built by mkdocs and opened in a real
browser. Only the public surface (no private name, no GuardStats bookkeeping, no module attribute left by
``llama_guard/__init__.py``), and headings that are names, with each signature in a code block under its heading
rather than a heading several lines tall. Needs Chromium (the Debian package ``chromium``) and the docs tools;
skipped without them."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llama_guard

Image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot (it comes with matplotlib)")
pytest.importorskip("mkdocs", reason="the docs tools build the page: pip install -e '.[docs]'")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,  # a site build and a browser, about 10 s
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium"),
]

#: Names that are the transports' bookkeeping or private, and must not be on the page.
INTERNALS = ("_value", "_name", "_present_as_public", "record_request", "record_probe", "record_retry", "add", "reset")

#: Run in the page once it is laid out: the height, font size and text of every API heading, into the DOM.
MEASURE = """
<script>
window.addEventListener("load", () => {
  const rows = [...document.querySelectorAll(".doc-heading")].map((el) => ({
    id: el.id,
    text: el.textContent.trim(),
    height: el.getBoundingClientRect().height,
    font: parseFloat(getComputedStyle(el).fontSize),
  }));
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify(rows);
  document.body.appendChild(out);
});
</script>
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    return folder


def _chromium(*arguments: str, profile: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1200,900",
        *arguments,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=90, check=True)


def test_only_the_public_surface_is_listed(site: Path) -> None:
    page = (site / "api" / "index.html").read_text("utf-8")
    ids = set(re.findall(r'id="(llama_guard[\w.]*)"', page))
    assert "llama_guard.GuardPolicy" in ids  # the page has the API at all
    assert "llama_guard.GuardStats.of_origin" in ids  # reading counters stays
    for name in llama_guard.__all__:
        if not name.startswith("__") and not inspect.ismodule(getattr(llama_guard, name)):
            assert f"llama_guard.{name}" in ids, name
    leaked = sorted(item for item in ids if item.rsplit(".", 1)[-1] in INTERNALS or "._" in item)
    assert not leaked, leaked


def test_signatures_are_code_blocks_under_short_headings(site: Path, tmp_path: Path) -> None:
    """In the browser: every API heading is one line of a name (no parenthesis of a signature in it, at most about
    two lines tall), and GuardPolicy's signature is a code block of its own. The first screen shows the page."""
    api = site / "api" / "index.html"
    measured_page = api.with_name("measured.html")
    measured_page.write_text(api.read_text("utf-8").replace("</body>", MEASURE + "</body>"), "utf-8")
    dom = _chromium("--dump-dom", measured_page.as_uri(), profile=tmp_path / "profile").stdout
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, "the measuring script did not run"
    rows = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<"))
    assert len(rows) > 30
    too_tall = [row for row in rows if row["height"] > 2.6 * row["font"]]
    assert not too_tall, too_tall
    signatures = [row for row in rows if "(" in row["text"]]
    assert not signatures, signatures
    page = api.read_text("utf-8")
    policy = page.index('id="llama_guard.GuardPolicy"')
    assert 'class="doc-signature' in page[policy : policy + 3000]

    shot = tmp_path / "api.png"
    _chromium(f"--screenshot={shot}", api.as_uri(), profile=tmp_path / "profile")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 900)
    content = image.crop((0, 100, 900, 900))
    data = content.tobytes()
    dark = sum(1 for index in range(0, len(data), 3) if data[index] + data[index + 1] + data[index + 2] < 300)
    assert dark > 2000, "the first screen shows no text"
