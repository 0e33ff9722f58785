"""``doctor --report``: the findings and the first-byte latency of every connection, as HTML or PNG.

HTML is self-contained (inline SVG, no script, no extra package). PNG needs matplotlib, which llama_guard does not
depend on; ``check_report_path`` says so before any check runs, not after a minute of tests.

Two charts: the burst (each connection's first byte, in connect order; a connection that got nothing within the
window is a cross at the top) and the pooled load (each request's first byte over time, plain httpx and the
guard; a lost request is a cross at the top).
"""

from __future__ import annotations

import html
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from .model import AFFECTED, NOT_AFFECTED, DoctorError, DoctorRun, Finding

__all__ = ["check_report_path", "render_html", "write_report"]

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


def _charts(run: DoctorRun) -> list[_Chart]:
    charts: list[_Chart] = []
    burst = run.burst
    if burst is not None and burst.rounds:
        series = tuple(
            _Series(
                f"burst {number} ({item.stalled} of {burst.connections} unanswered)",
                tuple((float(index), value) for index, value in enumerate(item.first_bytes)),
            )
            for number, item in enumerate(burst.rounds, 1)
        )
        window = burst.rounds[0].window
        charts.append(
            _Chart(
                f"Burst: {burst.connections} connections opened at once, GET /health on each",
                "connection (in connect order)",
                series,
                (window, f"no answer within {window:g} s"),
            )
        )
    loads = [row for row in (run.plain, run.guard) if row is not None and row.timeline]
    if loads:
        charts.append(
            _Chart(
                "Pooled load: first byte of every request (every second one streamed)",
                "seconds since the load began",
                tuple(
                    _Series(
                        f"{row.client}: {row.errors} of {row.requests} lost",
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
            if check.reuse is not None:
                outcome += f"; second request {check.reuse}"
        rows.append((name, first, outcome))
    return rows


# -- SVG ---------------------------------------------------------------------------------------------------------

_W, _H = 760, 320
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 36, 64


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exponent = float(10.0 ** math.floor(math.log10(value)))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exponent:
            return step * exponent
    return 10 * exponent  # pragma: no cover - the loop always returns


def _svg(chart: _Chart) -> str:
    values = [v for series in chart.series for _, v in series.points if v is not None]
    ceiling = max([*values, chart.line[0] if chart.line else 0.0, 0.001])
    y_max = _nice_max(ceiling * 1.05)
    xs = [x for series in chart.series for x, _ in series.points]
    x_min, x_max = min(xs, default=0.0), max(xs, default=1.0)
    x_span = (x_max - x_min) or 1.0
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    lost_y = _TOP - 12  # crosses for "no answer" sit above the plot area

    def px(x: float) -> float:
        return _LEFT + (x - x_min) / x_span * plot_w

    def py(y: float) -> float:
        return _TOP + plot_h - y / y_max * plot_h

    e = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
        f'role="img" aria-label="{e(chart.title)}" font-family="sans-serif" font-size="11">',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>',
        f'<text x="{_LEFT}" y="{lost_y - 8}">&#215; at the top: no answer</text>',
    ]
    for step in range(6):
        tick = y_max * step / 5
        y = py(tick)
        parts.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        label = f"{tick * 1000:.0f} ms" if y_max < 1 else f"{tick:.2g} s"
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    if chart.line is not None:
        y = py(chart.line[0])
        parts.append(
            f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#888" stroke-dasharray="4 3"/>'
        )
        parts.append(f'<text x="{_W - _RIGHT - 4}" y="{y - 4:.1f}" text-anchor="end">{e(chart.line[1])}</text>')
    for number, series in enumerate(chart.series):
        colour = _SERIES_COLOURS[number % len(_SERIES_COLOURS)]
        for x, value in series.points:
            if value is None:
                cx = px(x)
                parts.append(
                    f'<path d="M{cx - 4:.1f},{lost_y - 4} l8,8 m0,-8 l-8,8" stroke="{colour}" stroke-width="1.5"/>'
                )
            else:
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(value):.1f}" r="2.6" fill="{colour}" opacity="0.8"/>')
        legend_y = _H - 8
        legend_x = _LEFT + number * 230
        parts.append(f'<circle cx="{legend_x + 5}" cy="{legend_y - 4}" r="4" fill="{colour}"/>')
        parts.append(f'<text x="{legend_x + 14}" y="{legend_y}">{e(series.label)}</text>')
    for step in range(6):
        tick_x = x_min + x_span * step / 5
        shown = f"{tick_x:.0f}" if x_span >= 10 else f"{tick_x:.2g}"
        parts.append(f'<text x="{px(tick_x):.1f}" y="{_TOP + plot_h + 14}" text-anchor="middle">{shown}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_H - 30}" text-anchor="middle">{e(chart.xlabel)}</text>')
    parts.append(
        f'<text transform="translate(14 {_TOP + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">first byte</text>'
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


def render_html(run: DoctorRun, exit_status: int) -> str:
    e = html.escape
    identity = run.identity
    facts = [("URL", run.target.url)]
    if identity is not None:
        facts += [
            ("Server", identity.server_header or "-"),
            ("Build", identity.build_info or "not reported"),
            ("Model", identity.model or "-"),
            ("Slots", str(identity.total_slots) if identity.total_slots is not None else "-"),
        ]
    facts.append(("Checks took", f"{run.seconds:.1f} s"))
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in facts)
    raw = "".join(
        f"<tr><td>{e(name)}</td><td>{e(first)}</td><td>{e(outcome)}</td></tr>"
        for name, first, outcome in _raw_rows(run)
    )
    affected = sum(1 for item in run.findings if item.status == AFFECTED)
    healthy = sum(1 for item in run.findings if item.status == NOT_AFFECTED)
    charts = "".join(f"<h2>{e(chart.title)}</h2>{_svg(chart)}" for chart in _charts(run))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llama-guard doctor: {e(run.target.url)}</title>
<style>
body {{ font-family: sans-serif; max-width: 820px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: 2px 10px 2px 0; vertical-align: top; }}
.badge {{ color: #fff; border-radius: 3px; padding: 1px 6px; font-size: 90%; }}
.finding {{ margin: 1em 0; }} .fix {{ margin-left: 2.5em; }}
</style></head><body>
<h1>llama-guard doctor</h1>
<table>{rows}</table>
<p>{affected} defect(s) affected, {healthy} not affected; exit status {exit_status}.</p>
{"".join(_finding_html(item) for item in run.findings)}
<h2>Connections of the keep-alive checks</h2>
<table><tr><th>request</th><th>first byte</th><th>what happened</th></tr>{raw}</table>
{charts}
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
        top = max(ceiling, chart.line[0] if chart.line else 0.0) * 1.15
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
