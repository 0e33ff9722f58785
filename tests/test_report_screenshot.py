"""The doctor's HTML report in a real browser: at 1200x900 the verdict and both charts are in the first screen,
and the charts have marks in them. Needs Chromium (the Debian package ``chromium``); skipped without it."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from llama_guard._cli.doctor.model import BurstCheck, BurstRound, DoctorRun, Identity, KeepAliveCheck, Target
from llama_guard._cli.doctor.report import nice_ticks, render_html, seconds_label
from llama_guard._cli.doctor.verdict import LoadShape, exit_code, findings, load_evidence
from llama_guard._cli.load import LoadRow

Image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot (it comes with matplotlib)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

#: Colours of the report: the plot area's background and the first two series.
PLOT_BACKGROUND = (0xFA, 0xFA, 0xFA)
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)


def _run(*, with_charts: bool) -> DoctorRun:
    keep = {"status": 200, "keep_alive_header": "timeout=5, max=100", "connection_header": None}
    run = DoctorRun(Target("127.0.0.1", 8080), started=0.0, seconds=12.3)
    run.identity = Identity("llama.cpp", "b11434-emulated", 11434, "model.gguf", 4)
    run.stream = KeepAliveCheck(True, after="eof", closed_after=0.0001, first_byte=0.004, chunked=True, **keep)
    run.nonstream = KeepAliveCheck(False, after="open", reuse="answered 200", first_byte=0.004, **keep)
    if with_charts:
        rng = random.Random(7)
        run.burst = BurstCheck(16, (BurstRound(tuple([0.004] * 4 + [None] * 12), window=3.0),))
        run.plain, run.guard = LoadRow("pooled load", "plain httpx"), LoadRow("pooled load", "guard")
        for index in range(200):
            lost = index % 5 == 0
            run.plain.record(None if lost else rng.uniform(0.005, 0.04), "lost" if lost else None, at=index * 0.01)
            run.guard.record(rng.uniform(0.005, 0.04), at=index * 0.01)
    load = load_evidence(run.plain, run.guard, LoadShape(8, 4))
    run.findings = findings(run.identity, run.stream, run.nonstream, run.burst, load)
    return run


def _screenshot(run: DoctorRun, folder: Path) -> Image.Image:
    assert CHROMIUM is not None
    page = folder / "report.html"
    page.write_text(render_html(run, exit_code(run.findings)), "utf-8")
    shot = folder / "shot.png"
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
        f"--user-data-dir={folder / 'profile'}",
        "--window-size=1200,900",
        f"--screenshot={shot}",
        page.as_uri(),
    ]
    subprocess.run(command, capture_output=True, timeout=90, check=True)
    return Image.open(shot).convert("RGB")


def _count(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 24) -> int:
    """Pixels within ``tolerance`` of ``colour`` in every channel."""
    data = image.tobytes()
    red, green, blue = colour
    return sum(
        1
        for index in range(0, len(data), 3)
        if abs(data[index] - red) <= tolerance
        and abs(data[index + 1] - green) <= tolerance
        and abs(data[index + 2] - blue) <= tolerance
    )


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium for the screenshot: apt-get install -y chromium")
def test_the_charts_are_in_the_first_screen_and_not_empty(tmp_path: Path) -> None:
    full = _screenshot(_run(with_charts=True), tmp_path)
    assert full.size == (1200, 900)
    # Two plot areas of about 484 x 212 px each, whole in the first screen.
    assert _count(full, PLOT_BACKGROUND, tolerance=0) > 2 * 0.9 * 484 * 212
    # And marks in them: the burst's and the load's dots and crosses in both series' colours.
    assert _count(full, BLUE) > 300
    assert _count(full, ORANGE) > 300

    # The control: the same check on a report without charts finds neither, so it can fail.
    (tmp_path / "bare").mkdir()
    bare = _screenshot(_run(with_charts=False), tmp_path / "bare")
    assert _count(bare, PLOT_BACKGROUND, tolerance=0) < 1000
    assert _count(bare, BLUE) < 50


@pytest.mark.parametrize(
    ("high", "labels"),
    [
        (3.0, ["0 s", "1 s", "2 s", "3 s"]),  # the burst's 3 s window: the axis ends at 3 s, not 5
        (0.068, ["0 ms", "20 ms", "40 ms", "60 ms", "80 ms"]),
        (0.00029, ["0 ms", "0.1 ms", "0.2 ms", "0.3 ms"]),
        (7.3, ["0 s", "2 s", "4 s", "6 s", "8 s"]),
        (1.2, ["0 s", "0.25 s", "0.50 s", "0.75 s", "1.00 s", "1.25 s"]),
    ],
)
def test_axis_ticks_are_round_numbers_with_units(high: float, labels: list[str]) -> None:
    ticks = nice_ticks(high)
    step = ticks[1] - ticks[0]
    assert [seconds_label(tick, step, ticks[-1]) for tick in ticks] == labels


def test_the_burst_axis_ends_at_its_window() -> None:
    text = render_html(_run(with_charts=True), 1)
    burst_svg = text[text.index("<svg") : text.index("</svg>")]
    assert ">3 s</text>" in burst_svg
    assert ">4 s</text>" not in burst_svg
    assert ">5 s</text>" not in burst_svg
