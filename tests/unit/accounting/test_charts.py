"""The accounting pages' charts (matplotlib, SVG): every day labelled, axes with units, budgets labelled."""

from __future__ import annotations

import html
import re

import pytest

from gpupool.hub.accounting import charts


def texts(svg: str) -> list[str]:
    return [html.unescape(t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def test_a_whole_month_has_one_label_per_day():
    svg = charts.daily_chart("GPU-hours per day", [(f"2026-11-{d:02d}", d / 10) for d in range(1, 31)], "GPU-h")
    assert texts(svg)[:30] == [str(d) for d in range(1, 31)]
    assert "day of November 2026 (UTC)" in texts(svg) and "GPU-h" in texts(svg)
    assert svg.startswith('<svg role="img" aria-label="GPU-hours per day"') and "<script" not in svg
    assert not re.search(r"(src|href)=\"https?:", svg), "nothing fetched"


def test_bars_are_labelled_with_values_and_the_budget_with_its_value():
    found = texts(charts.bar_chart("Team vision", [("vision", 0.75), ("you", 0.5)], "GPU-h", limit=100))
    assert {"vision", "you", "0.75 GPU-h", "0.5 GPU-h", "budget 100 GPU-h", "GPU-h"} <= set(found)


@pytest.mark.parametrize("ratios, top", [([0.0015, 0.0], 0.01), ([0.03], 0.05), ([0.125], 0.2), ([0.9], 1.0),
                                         ([], 0.01), ([1.0], 1.0)])
def test_utilisation_is_on_a_scale_that_fits_the_busiest_day(ratios, top):
    assert charts.utilisation_scale(ratios) == top


def test_utilisation_axis_is_in_percent():
    found = texts(charts.utilisation_chart("H200", [("2026-11-01", 0.0015), ("2026-11-02", 0.004)]))
    assert "1.0%" in found and "0.0%" in found and "allocated / capacity" in found


def test_the_idle_charts_100_percent_line_says_what_it_is_not_a_budget():
    # On "All teams": each team's share of its GPU-hours held idle; 100 % is every GPU-hour idle, not a budget.
    found = texts(charts.idle_chart("Teams: share of their GPU-hours held by idle servers and jobs",
                                    [("vision", 12.5), ("nlp", 0.0)]))
    assert {"vision", "nlp", "12.5 %", "all GPU-hours idle: 100 %"} <= set(found), found
    assert not any("budget" in text for text in found), found
