"""``doctor --report``: the findings and the first-byte latency of every connection, as HTML or PNG.

HTML is self-contained (inline SVG, no script, no extra package). PNG needs matplotlib, which llama_guard does not
depend on; ``check_report_path`` says so before any check runs, not after a minute of tests.

Two charts: the burst (each connection's first byte, in connect order; a connection that got nothing within the
window is a cross at the top) and the pooled load (each request's first byte over time, plain httpx and the
guard; a lost or stuck request is a cross at the top).
"""

from __future__ import annotations

import html
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from .model import (
    AFFECTED,
    COULD_NOT_TELL,
    NOT_AFFECTED,
    REUSE_CLOSED,
    REUSE_RESET,
    DoctorError,
    DoctorRun,
    Finding,
)

__all__ = ["check_report_path", "nice_ticks", "render_html", "seconds_label", "write_report"]

_SUFFIXES = (".html", ".htm", ".png")
_STATUS_TEXT = {"affected": "affected", "not_affected": "not affected", "could_not_tell": "could not tell"}
_STATUS_COLOUR = {"affected": "#c0392b", "not_affected": "#27ae60", "could_not_tell": "#7f8c8d"}
_SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")


def check_report_path(path: Path) -> None:
    """DoctorError unless ``path`` ends in .html/.htm/.png, its folder exists, and PNG can be drawn."""
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DoctorError(f"--report {path}: the file name must end in .html or .png")
    if not path.parent.is_dir():
        raise DoctorError(f"--report {path}: the folder {path.parent} does not exist")
    if suffix == ".png" and importlib.util.find_spec("matplotlib") is None:
        raise DoctorError(
            f"--report {path}: a PNG report needs matplotlib (pip install matplotlib); or write FILE.html instead"
        )


@dataclass(frozen=True)
class _Series:
    label: str
    #: (x, first-byte seconds or None for "no answer")
    points: tuple[tuple[float, float | None], ...]


@dataclass(frozen=True)
class _Chart:
    title: str
    xlabel: str
    series: tuple[_Series, ...]
    #: A horizontal line (seconds) and its label, e.g. the burst's window.
    line: tuple[float, str] | None = None
    #: The y axis's top when it is fixed (the burst's window); else a round number above the highest value.
    y_top: float | None = None
    #: The x axis counts things (connections: whole numbers from 1), or is time in seconds.
    x_counts: bool = False


def _charts(run: DoctorRun) -> list[_Chart]:
    charts: list[_Chart] = []
    burst = run.burst
    if burst is not None and burst.rounds:
        series = tuple(
            _Series(
                f"burst {number}: {item.stalled} of {burst.connections} unanswered",
                tuple((float(index), value) for index, value in enumerate(item.first_bytes, 1)),
            )
            for number, item in enumerate(burst.rounds, 1)
        )
        window = burst.rounds[0].window
        charts.append(
            _Chart(
                f"Burst: {burst.connections} connections opened at once, GET /health on each",
                "connection (in connect order)",
                series,
                (window, f"window: {window:g} s"),
                y_top=window,
                x_counts=True,
            )
        )
    loads = [row for row in (run.plain, run.guard) if row is not None and row.timeline]
    if loads:
        charts.append(
            _Chart(
                "Pooled load: first byte of every request (every second one streamed)",
                "time since the load began",
                tuple(
                    _Series(
                        f"{row.client}: {row.errors} lost"
                        + (f", {row.stuck} stuck" if row.stuck else "")
                        + f" of {row.requests}",
                        tuple((at, first) for at, first, _ in row.timeline),
                    )
                    for row in loads
                ),
            )
        )
    return charts


def _raw_rows(run: DoctorRun) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for name, check in (("streamed completion", run.stream), ("non-streamed completion", run.nonstream)):
        if check is None:
            continue
        first = f"{check.first_byte * 1000:.1f} ms" if check.first_byte is not None else "-"
        if check.error is not None:
            outcome = check.error
        else:
            outcome = f"HTTP {check.status}, then: {check.after or 'not watched'}"
            if check.closed_after is not None:
                outcome += f" after {check.closed_after * 1000:.2f} ms"
            if check.reuse in (REUSE_CLOSED, REUSE_RESET):
                outcome += f"; then the server {check.reuse}"
            elif check.reuse is not None:
                outcome += f"; second request {check.reuse}"
        rows.append((name, first, outcome))
    return rows


# -- SVG ---------------------------------------------------------------------------------------------------------

_W, _H = 560, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 12, 30, 58


def nice_ticks(high: float, count: int = 5, *, whole: bool = False) -> list[float]:
    """Round ticks from 0 to at least ``high``: steps of 1, 2, 2.5 or 5 times a power of ten, about ``count`` of
    them (``whole``: steps of at least 1, for counts)."""
    high = high if high > 0 else 1.0
    raw = high / count
    exponent = 10.0 ** math.floor(math.log10(raw))
    step = next(m * exponent for m in (1, 2, 2.5, 5, 10) if m * exponent >= raw * (1 - 1e-9))
    if whole:
        step = max(1.0, round(step))
    steps = math.ceil(high / step - 1e-9)
    return [round(index * step, 12) for index in range(steps + 1)]


def seconds_label(value: float, step: float, top: float) -> str:
    """A tick's label with its unit: ms below a second's range (``0 ms, 50 ms``), else s (``0 s, 0.5 s``)."""
    if top < 1.0:
        value, step, unit = value * 1000, step * 1000, "ms"
    else:
        unit = "s"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    if decimals and abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6:
        decimals += 1  # 2.5 steps need one more
    return f"0 {unit}" if value == 0 else f"{value:.{decimals}f} {unit}"


def _svg(chart: _Chart) -> str:
    values = [v for series in chart.series for _, v in series.points if v is not None]
    y_ticks = nice_ticks(chart.y_top if chart.y_top is not None else max([*values, 0.001]) * 1.02)
    y_max = y_ticks[-1]
    xs = [x for series in chart.series for x, _ in series.points]
    if chart.x_counts:
        last = max(xs, default=1.0)  # the axis ends at the last connection, not at a round number past it
        x_ticks = [1.0, *(float(tick) for tick in nice_ticks(last, whole=True) if 1 < tick <= last)]
        x_min, x_max = 0.5, last + 0.5
    else:
        x_ticks = nice_ticks(max(xs, default=1.0))
        x_min, x_max = 0.0, x_ticks[-1]
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    lost_y = _TOP - 10  # crosses for "no answer" sit above the plot area

    def px(x: float) -> float:
        return _LEFT + (x - x_min) / (x_max - x_min) * plot_w

    def py(y: float) -> float:
        return _TOP + plot_h - min(y, y_max) / y_max * plot_h

    e = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
        f'role="img" aria-label="{e(chart.title)}" font-family="sans-serif" font-size="11">',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>',
        f'<text x="{_W - _RIGHT}" y="{lost_y - 8}" text-anchor="end">&#215; above the plot: no answer</text>',
    ]
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else y_max
    for tick in y_ticks:
        y = py(tick)
        parts.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        label = seconds_label(tick, y_step, y_max)
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    if chart.line is not None:
        y = py(chart.line[0])
        parts.append(
            f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#888" stroke-dasharray="4 3"/>'
        )
        parts.append(f'<text x="{_W - _RIGHT - 4}" y="{y + 13:.1f}" text-anchor="end">{e(chart.line[1])}</text>')
    for number, series in enumerate(chart.series):
        colour = _SERIES_COLOURS[number % len(_SERIES_COLOURS)]
        for x, value in series.points:
            if value is None:
                cx = px(x)
                parts.append(
                    f'<path d="M{cx - 4:.1f},{lost_y - 4} l8,8 m0,-8 l-8,8" stroke="{colour}" stroke-width="1.5"/>'
                )
            else:
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(value):.1f}" r="2.8" fill="{colour}"/>')
        legend_y = _H - 6
        legend_x = _LEFT + number * 200
        parts.append(f'<circle cx="{legend_x + 5}" cy="{legend_y - 4}" r="4" fill="{colour}"/>')
        parts.append(f'<text x="{legend_x + 14}" y="{legend_y}">{e(series.label)}</text>')
    x_step = x_ticks[-1] - x_ticks[-2] if len(x_ticks) > 1 else 1.0
    for tick in x_ticks:
        shown = f"{tick:.0f}" if chart.x_counts else seconds_label(tick, x_step, max(x_ticks[-1], 1.0))
        parts.append(f'<text x="{px(tick):.1f}" y="{_TOP + plot_h + 14}" text-anchor="middle">{shown}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_H - 24}" text-anchor="middle">{e(chart.xlabel)}</text>')
    parts.append(
        f'<text transform="translate(12 {_TOP + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">first byte</text>'
    )
    parts.append("</svg>")
    return "\n".join(parts)


def _finding_html(item: Finding) -> str:
    e = html.escape
    colour = _STATUS_COLOUR[item.status]
    evidence = "".join(f"<li>{e(line)}</li>" for line in item.evidence)
    fix = f'<p class="fix"><b>Fix:</b> {e(item.fix)}</p>' if item.fix else ""
    return (
        f'<div class="finding"><span class="badge" style="background:{colour}">{_STATUS_TEXT[item.status]}</span> '
        f"<b>{e(item.title)}</b><ul>{evidence}</ul>{fix}</div>"
    )


def _summary(run: DoctorRun, exit_status: int) -> tuple[str, str]:
    """The one-line verdict and its colour, as the text output's ``result:`` line says it."""
    affected = [item.defect for item in run.findings if item.status == AFFECTED]
    unknown = [item.defect for item in run.findings if item.status == COULD_NOT_TELL]
    if affected:
        text = "a client here is exposed: affected: " + ", ".join(affected)
        text += f"; could not tell: {', '.join(unknown)}" if unknown else ""
        return text, _STATUS_COLOUR[AFFECTED]
    if unknown:
        return f"could not tell: {', '.join(unknown)} (nothing found, but not everything examined)", _STATUS_COLOUR[
            COULD_NOT_TELL
        ]
    return "no defect found", _STATUS_COLOUR[NOT_AFFECTED]


def render_html(run: DoctorRun, exit_status: int) -> str:
    """The report: verdicts and charts in the first screen (1200x900), the evidence and fixes below."""
    e = html.escape
    identity = run.identity
    facts = []
    if identity is not None:
        facts += [
            f"server {identity.server_header or '-'}",
            f"build {identity.build_info or 'not reported'}",
            f"model {identity.model or '-'}",
            f"{identity.total_slots if identity.total_slots is not None else '?'} slots",
        ]
    if run.given_url:
        facts.append(f"found behind {run.given_url}")
    facts.append(f"checks took {run.seconds:.1f} s")
    raw = "".join(
        f"<tr><td>{e(name)}</td><td>{e(first)}</td><td>{e(outcome)}</td></tr>"
        for name, first, outcome in _raw_rows(run)
    )
    verdict, colour = _summary(run, exit_status)
    glance = "".join(
        f'<tr><td><span class="badge" style="background:{_STATUS_COLOUR[item.status]}">'
        f"{_STATUS_TEXT[item.status]}</span></td><td>{e(item.title)}</td></tr>"
        for item in run.findings
    )
    charts = "".join(
        f"<figure><figcaption>{e(chart.title)}</figcaption>{_svg(chart)}</figure>" for chart in _charts(run)
    )
    if not charts:
        charts = "<p>No load or burst was run (--requests 0, no --burst): no charts.</p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llama-guard doctor: {e(run.target.url)}</title>
<style>
body {{ font-family: sans-serif; max-width: 1160px; margin: 12px auto; padding: 0 12px; color: #222; }}
h1 {{ font-size: 1.35em; margin: 0 0 4px; }} h2 {{ font-size: 1.15em; margin: 1.2em 0 0.4em; }}
.facts {{ color: #555; margin: 0 0 8px; }}
.verdict {{ color: #fff; padding: 6px 10px; border-radius: 4px; font-weight: bold; margin: 0 0 8px; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: 2px 10px 2px 0; vertical-align: top; }}
.badge {{ color: #fff; border-radius: 3px; padding: 1px 6px; font-size: 90%; white-space: nowrap; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 16px; margin-top: 10px; }}
figure {{ margin: 0; }} figcaption {{ font-weight: bold; font-size: 0.9em; margin-bottom: 2px; }}
.finding {{ margin: 0.8em 0; }} .fix {{ margin-left: 2.5em; }}
</style></head><body>
<h1>llama-guard doctor {e(run.target.url)}</h1>
<p class="facts">{e("; ".join(facts))}</p>
<p class="verdict" style="background:{colour}">{e(verdict)} (exit status {exit_status})</p>
<table class="glance">{glance}</table>
<div class="charts">{charts}</div>
<h2>Evidence and fixes</h2>
{"".join(_finding_html(item) for item in run.findings)}
<h2>Connections of the keep-alive checks</h2>
<table><tr><th>request</th><th>first byte</th><th>what happened</th></tr>{raw}</table>
</body></html>
"""


def _write_png(run: DoctorRun, path: Path) -> None:
    # Imported only here: matplotlib is optional, and the Agg canvas draws without touching pyplot's global state.
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    charts = _charts(run)
    rows = max(len(charts), 1)
    figure = Figure(figsize=(9, 1.2 + 3.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, 1, squeeze=False)
    axes_list: list[Axes] = [grid[row, 0] for row in range(rows)]
    verdicts = "; ".join(f"{item.defect}: {_STATUS_TEXT[item.status]}" for item in run.findings)
    figure.suptitle(f"llama-guard doctor {run.target.url}\n{verdicts}", fontsize=10)
    for axes, chart in zip(axes_list, charts, strict=False):
        ceiling = max([v for s in chart.series for _, v in s.points if v is not None] + [0.001])
        # A fixed axis (the burst's window) ends just above it, where the crosses for "no answer" go.
        top = chart.y_top * 1.06 if chart.y_top is not None else ceiling * 1.15
        for number, series in enumerate(chart.series):
            colour = _SERIES_COLOURS[number % len(_SERIES_COLOURS)]
            answered = [(x, v) for x, v in series.points if v is not None]
            lost = [x for x, v in series.points if v is None]
            axes.scatter([x for x, _ in answered], [v for _, v in answered], s=10, color=colour, label=series.label)
            if lost:
                axes.scatter(lost, [top] * len(lost), marker="x", color=colour)
        if chart.line is not None:
            axes.axhline(chart.line[0], color="#888", linestyle="--", linewidth=0.8)
        axes.set_title(chart.title, fontsize=9)
        axes.set_xlabel(chart.xlabel)
        axes.set_ylabel("first byte (s); x at the top = no answer")
        axes.set_ylim(0, top * 1.05)
        axes.legend(fontsize=8, loc="center right")
    if not charts:
        axes_list[0].text(0.5, 0.5, "no load or burst was run", ha="center", va="center")
    figure.savefig(path, dpi=110)


def write_report(run: DoctorRun, path: Path, exit_status: int) -> None:
    """Write the report; DoctorError (one line) if the file cannot be written."""
    try:
        if path.suffix.lower() == ".png":
            _write_png(run, path)
        else:
            path.write_text(render_html(run, exit_status), "utf-8")
    except OSError as exc:
        raise DoctorError(f"cannot write the report {path}: {exc.strerror or exc}") from None
