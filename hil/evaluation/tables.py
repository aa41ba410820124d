"""Number formatting and Markdown tables shared by every report (analysis, paper experiment, benchmark).

A table with more than one comparison shows adjusted p-values beside the raw ones (or marks significance by the
adjusted ones) and states in its legend the correction, the family and the threshold (:func:`adjustment_legend`).

>>> markdown_table(["run", "nDCG@10"], [["bm25", 0.67623], ["colbert", None]])
['| run | nDCG@10 |', '|---|---|', '| bm25 | 0.6762 |', '| colbert | n/a |']
>>> pct(0.60312), relative(0.606, 0.603), p_value(0.00004), p_value(0.7912)
('60.31', '+0.5%', '<0.001', '0.79')
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from hil.evaluation.statistics import P_ADJUST_NAMES


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats to ``digits`` decimals (scientific below 1e-3), None as "n/a", anything else as is."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The lines of a GitHub Markdown table; each cell through :func:`fmt`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]


def _missing(value: float | None) -> bool:
    return value is None or not math.isfinite(value)


def pct(value: float | None, digits: int = 2) -> str:
    """A score in percent (nDCG@10 0.6031 -> "60.31"), "-" when missing."""
    return "-" if _missing(value) else f"{100 * value:.{digits}f}"


def relative(value: float | None, base: float | None) -> str:
    """The change from ``base`` to ``value`` in percent of ``base`` ("+0.5%"), "-" when undefined."""
    if _missing(value) or _missing(base) or base == 0:
        return "-"
    return f"{100 * (value - base) / base:+.1f}%"


def p_value(value: float | None) -> str:
    """Two significant digits, "<0.001" below that, "-" when missing."""
    if _missing(value):
        return "-"
    return f"{value:.2g}" if value >= 1e-3 else "<0.001"


def p_with_adjusted(raw: float | None, adjusted: float | None, method: str) -> str:
    """A raw p-value and, unless the method is "none", its adjusted value: ``"0.004 (holm 0.02)"``."""
    return p_value(raw) if method == "none" else f"{p_value(raw)} ({method} {p_value(adjusted)})"


def adjustment_legend(method: str, family: str, level: float | None = None, mark: str = "†",
                      test: str = "paired t-test") -> str:
    """The legend of a table with several comparisons: the correction, which comparisons were corrected together
    (``family``) and, when the table marks significance, the threshold of its mark: "Multiple comparisons: p-values
    adjusted by Holm-Bonferroni (family-wise error rate) within each family, a family being <family>; † =
    holm-adjusted paired t-test p < 0.01."
    """
    if method == "none":
        text, decides = "Multiple comparisons: p-values not adjusted (--p-adjust none)", test
    else:
        text = (f"Multiple comparisons: p-values adjusted by {P_ADJUST_NAMES[method]} within each family, a family "
                f"being {family}")
        decides = f"{method}-adjusted {test}"
    return text + (f"; {mark} = {decides} p < {level:g}." if level is not None else ".")
