"""The accounting pages' charts: matplotlib figures rendered to inline SVG on the server.

Nothing runs in the browser and nothing is fetched: each chart is one `<svg>` element with its text kept as
text (`svg.fonttype: none`, so it is searchable, selectable and scales with the page), axes with units, one
label per day, budget lines labelled with their value. Matplotlib's object API (`Figure`, no pyplot) keeps no
global figure registry. Matplotlib (and numpy) are imported at the first chart, not when the service starts:
an idle platform does not carry them.
"""

from __future__ import annotations

import io
import re
from contextlib import contextmanager
from datetime import date

#: Colours of the hub's Bootstrap theme (primary, danger, secondary) so charts look like the rest of the hub.
BAR, LIMIT, GRID = "#0d6efd", "#dc3545", "#ced4da"
#: Text as <text> elements in the page's own font; ids salted per chart so several SVGs share one page.
RC = {"svg.fonttype": "none", "font.family": "sans-serif", "font.size": 10, "axes.spines.top": False,
      "axes.spines.right": False, "axes.titleweight": "bold", "axes.titlesize": 11, "axes.titlelocation": "left"}


@contextmanager
def _style(**more):
    """matplotlib with our settings, for the time of one chart."""
    import matplotlib

    with matplotlib.rc_context({**RC, **more}):
        yield matplotlib


def _svg(figure, title: str) -> str:
    """The figure as an inline `<svg>` (no XML prologue, no metadata), labelled for screen readers."""
    buffer = io.StringIO()
    with _style(**{"svg.hashsalt": title}):
        figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    escaped = title.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    return text.replace("<svg ", f'<svg role="img" aria-label="{escaped}" class="gpupool-chart" ', 1)


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    with _style():
        figure = Figure(figsize=(width, height), layout="constrained")
        figure.add_subplot()
    return figure


def _number(value: float) -> str:
    """A GPU-hour amount the way people read it: 0.75, 12.5, 1,234."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:,.2f}".rstrip("0").rstrip(".")


def bar_chart(title: str, bars: list[tuple[str, float]], unit: str, *, limit: float | None = None,
              limit_label: str = "budget") -> str:
    """Horizontal bars, one per label, each with its value written beside it; `limit` draws a labelled line."""
    from matplotlib.ticker import FuncFormatter

    with _style():
        figure = _figure(7.5, 1.2 + 0.4 * max(1, len(bars)))
        axes = figure.axes[0]
        labels = [label for label, _ in bars] or ["(none)"]
        values = [value for _, value in bars] or [0.0]
        positions = range(len(labels))
        axes.barh(positions, values, color=BAR, height=0.6)
        axes.set_yticks(list(positions), labels)
        axes.invert_yaxis()  # the first bar on top, as in a table
        top = max(values + [limit or 0])
        axes.set_xlim(0, top * 1.25 if top > 0 else 1)
        for y, value in zip(positions, values):
            axes.annotate(f"{_number(value)} {unit}", (value, y), xytext=(4, 0), textcoords="offset points",
                          va="center")
        if limit:
            # Labelled in a legend beside the axes: a label on the line itself would sit on the bars.
            axes.axvline(limit, color=LIMIT, linestyle="--", linewidth=1.5,
                         label=f"{limit_label} {_number(limit)} {unit}")
            axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, labelcolor=LIMIT)
        axes.set_xlabel(unit)
        axes.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _number(v)))
        axes.grid(axis="x", color=GRID, linewidth=0.6)
        axes.set_axisbelow(True)
        axes.set_title(title)
        return _svg(figure, title)


def idle_chart(title: str, teams: list[tuple[str, float]]) -> str:
    """Each team's share of its GPU-hours held by idle servers and jobs, in percent. Its 100 % line is the
    bound of that share (every GPU-hour of the team idle), not a budget: it is labelled so."""
    return bar_chart(title, teams, "%", limit=100.0, limit_label="all GPU-hours idle:")


def _day_axis(axes, days: list[date]) -> None:
    """One tick per day, labelled with its day of the month; the month and year name the axis."""
    axes.set_xticks(range(len(days)), [str(d.day) for d in days])
    axes.set_xlim(-0.6, max(len(days), 7) - 0.4)
    axes.tick_params(axis="x", labelsize=8 if len(days) > 20 else 9)
    if days:
        axes.set_xlabel(f"day of {days[0].strftime('%B %Y')} (UTC)")


def daily_chart(title: str, days: list[tuple[str, float]], unit: str) -> str:
    """Columns of an amount per day (ISO dates), every day labelled, the y axis in `unit`."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    with _style():
        figure = _figure(7.5, 2.9)
        axes = figure.axes[0]
        dates = [date.fromisoformat(day) for day, _ in days]
        values = [value for _, value in days]
        axes.bar(range(len(values)), values, color=BAR, width=0.7)
        _day_axis(axes, dates)
        top = max(values + [0])
        axes.set_ylim(0, top * 1.15 if top > 0 else 1)
        axes.yaxis.set_major_locator(MaxNLocator(5))
        axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _number(v)))
        axes.set_ylabel(unit)
        axes.grid(axis="y", color=GRID, linewidth=0.6)
        axes.set_axisbelow(True)
        axes.set_title(title)
        return _svg(figure, title)


#: The tops a utilisation axis may have: the smallest one above the busiest day (with room for it) is used.
SCALES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def utilisation_scale(ratios: list[float]) -> float:
    """The top of a utilisation axis: 1 %, 2 %, 5 %, 10 %, 20 %, 50 % or 100 %, above the busiest day."""
    highest = max(ratios + [0.0]) * 1.15
    return next((top for top in SCALES if top >= highest), 1.0)


def utilisation_chart(title: str, days: list[tuple[str, float]]) -> str:
    """Allocated / capacity per day in percent, the axis scaled to the data (a quiet pool is not a flat line)."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    with _style():
        figure = _figure(7.5, 2.9)
        axes = figure.axes[0]
        dates = [date.fromisoformat(day) for day, _ in days]
        ratios = [ratio for _, ratio in days]
        axes.bar(range(len(ratios)), ratios, color=BAR, width=0.7)
        _day_axis(axes, dates)
        top = utilisation_scale(ratios)
        axes.set_ylim(0, top)
        axes.yaxis.set_major_locator(MaxNLocator(5))
        axes.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0 if top >= 0.05 else 1))
        axes.set_ylabel("allocated / capacity")
        axes.grid(axis="y", color=GRID, linewidth=0.6)
        axes.set_axisbelow(True)
        axes.set_title(title)
        return _svg(figure, title)


def timeline_chart(title: str, points: list[tuple[float, float, int]], capacity: float) -> str:
    """A replay's timeline: GPUs allocated / capacity (area, left axis, percent) and requests waiting in the
    queue (line, right axis), against days since the workload's start. `points`: (seconds, GPUs held, waiting)."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    with _style():
        figure = _figure(7.5, 3.0)
        axes = figure.axes[0]
        days = [t / 86400 for t, _, _ in points]
        used = [held / capacity if capacity else 0.0 for _, held, _ in points]
        waiting = [n for _, _, n in points]
        axes.fill_between(days, used, step="post", color=BAR, alpha=0.35, linewidth=0)
        axes.step(days, used, where="post", color=BAR, linewidth=1.2, label="allocated / capacity")
        axes.set_ylim(0, 1.0)
        axes.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        axes.set_ylabel("allocated / capacity", color=BAR)
        axes.set_xlabel("days since the workload's first arrival")
        axes.grid(axis="y", color=GRID, linewidth=0.6)
        axes.set_axisbelow(True)
        queue = axes.twinx()
        queue.spines["right"].set_visible(True)
        queue.step(days, waiting, where="post", color=LIMIT, linewidth=1.2, label="requests waiting")
        queue.set_ylim(0, max(waiting + [1]) * 1.15)
        queue.yaxis.set_major_locator(MaxNLocator(5, integer=True))
        queue.set_ylabel("requests waiting", color=LIMIT)
        if days:
            axes.set_xlim(days[0], max(days[-1], days[0] + 1e-6))
        axes.set_title(title)
        return _svg(figure, title)
