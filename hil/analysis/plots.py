"""Figures of the analysis report, drawn with matplotlib's Agg backend (no display) and saved as small PNGs.

Each function takes plain numbers (the report computes them), writes one PNG and returns its path:
``plot_cosine_distributions`` (HIL Fig. 2), ``plot_layer_inter_iso`` (HIL Fig. 5), ``plot_overlap`` (HIL Fig. 3,
two circles drawn with patches), ``plot_isotropy`` (I(W) / Avg-Cos / IsoScore before and after transforms) and
``plot_intervals`` (bootstrap confidence intervals of a metric per run) and ``plot_scatter`` (labelled points).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: never open a window, work without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Circle  # noqa: E402

from hil.analysis.layers import log_difference  # noqa: E402

DPI = 100
ISOTROPY_COLOR = "tab:orange"    # HIL Fig. 2/3: orange = isotropic
ANISOTROPY_COLOR = "tab:blue"    # blue = anisotropic


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_cosine_distributions(series: Mapping[str, np.ndarray], path: str | Path, *, bins: int = 80,
                              title: str = "Query-document token cosine similarities") -> Path:
    """Density of each series' cosines on [-1, 1] with the ideal isotropy (0) and anisotropy (1) marked."""
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.linspace(-1.0, 1.0, bins + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    for label, values in series.items():
        values = np.asarray(values, dtype=float)
        if values.size == 0:
            continue
        density, _ = np.histogram(np.clip(values, -1, 1), bins=edges, density=True)
        ax.plot(centres, density, label=f"{label} (mean {values.mean():.2f})", linewidth=1.5)
    ax.axvline(0.0, color=ISOTROPY_COLOR, linestyle="--", linewidth=1, label="ideal isotropy")
    ax.axvline(1.0, color=ANISOTROPY_COLOR, linestyle="--", linewidth=1, label="ideal anisotropy")
    ax.set_xlabel("cosine similarity (query token, document token)")
    ax.set_ylabel("density")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_layer_inter_iso(curves: Mapping[str, np.ndarray], path: str | Path, *, reference: str | None = None) -> Path:
    """InterIso per layer; with ``reference``, a second panel of ``log10`` differences to it (HIL Fig. 5)."""
    panels = 2 if reference is not None and len(curves) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0, 0]
    for label, values in curves.items():
        ax.plot(np.arange(len(values)), values, marker="o", markersize=3, label=label)
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("InterIso (mean query-doc token cosine)")
    ax.set_title("InterIso per backbone layer")
    ax.legend(fontsize=8)
    if panels == 2:
        ax = axes[0, 1]
        for label, values in curves.items():
            if label == reference:
                continue
            diff = log_difference(values, curves[reference])
            ax.plot(np.arange(len(diff)), diff, marker="o", markersize=3, label=label)
        ax.axhline(0.0, color="grey", linewidth=1)
        ax.set_xlabel("layer (0 = embeddings)")
        ax.set_ylabel(f"log10 InterIso - log10 InterIso[{reference}]")
        ax.set_title(f"Difference to {reference} (log scale)")
        ax.legend(fontsize=8)
    return _save(fig, path)


def _circle_distance(r_a: float, r_b: float, overlap: float) -> float:
    """Centre distance of two circles whose lens area is ``overlap`` (bisection on the exact lens formula)."""
    def lens(d: float) -> float:
        if d >= r_a + r_b:
            return 0.0
        if d <= abs(r_a - r_b):
            return math.pi * min(r_a, r_b) ** 2
        a = r_a ** 2 * math.acos((d * d + r_a ** 2 - r_b ** 2) / (2 * d * r_a))
        b = r_b ** 2 * math.acos((d * d + r_b ** 2 - r_a ** 2) / (2 * d * r_b))
        c = 0.5 * math.sqrt((-d + r_a + r_b) * (d + r_a - r_b) * (d - r_a + r_b) * (d + r_a + r_b))
        return a + b - c

    lo, hi = abs(r_a - r_b), r_a + r_b
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if lens(mid) > overlap else (lo, mid)
    return (lo + hi) / 2


def plot_overlap(overlaps: Mapping[str, Mapping[str, Any]], path: str | Path,
                 title: str = "Documents retrieved by each head") -> Path:
    """One area-proportional two-circle Venn diagram per model (HIL Fig. 3); counts and shares written in."""
    n = max(1, len(overlaps))
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.8), squeeze=False)
    for ax, (label, row) in zip(axes[0], overlaps.items()):
        a, b = row["heads"]
        only_a, only_b, both = row[f"only_{a}"], row[f"only_{b}"], row["both"]
        total = max(1, only_a + only_b + both)
        area_a, area_b, area_both = (only_a + both) / total, (only_b + both) / total, both / total
        r_a, r_b = math.sqrt(max(area_a, 1e-6) / math.pi), math.sqrt(max(area_b, 1e-6) / math.pi)
        d = _circle_distance(r_a, r_b, area_both)  # circle areas = shares, lens area = shared share
        ax.add_patch(Circle((-d / 2, 0), r_a, color=ISOTROPY_COLOR, alpha=0.45))
        ax.add_patch(Circle((d / 2, 0), r_b, color=ANISOTROPY_COLOR, alpha=0.45))
        # each count in the middle of its region along the axis through both centres
        a_left, a_right, b_left, b_right = -d / 2 - r_a, -d / 2 + r_a, d / 2 - r_b, d / 2 + r_b
        for x, n in (((a_left + min(b_left, a_right)) / 2, only_a), ((max(a_right, b_left) + b_right) / 2, only_b),
                     ((max(a_left, b_left) + min(a_right, b_right)) / 2, both)):
            ax.text(x, 0, f"{n}\n{100 * n / total:.1f}%", ha="center", va="center", fontsize=8)
        ax.text(-d / 2, r_a + 0.03, a, ha="center", va="bottom", fontsize=10)
        ax.text(d / 2, r_b + 0.03, b, ha="center", va="bottom", fontsize=10)
        extent = max(r_a, r_b) + d / 2 + 0.1
        ax.set_xlim(-extent, extent)
        ax.set_ylim(-extent * 0.8, extent * 0.8)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


ISOTROPY_METRICS = (("I(W)", "I(W) (higher = isotropic)"), ("avg_cos", "Avg-Cos (lower = isotropic)"),
                    ("isoscore", "IsoScore (higher = isotropic)"))


def plot_isotropy(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Grouped bars: for each metric, one group per (head, queries/documents) and one bar per variant.

    ``rows`` hold ``variant``, ``head``, ``side`` and the metric values (as :func:`isotropy_scores` gives them).
    """
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    groups = list(dict.fromkeys((r["head"], r["side"]) for r in rows))
    lookup = {(r["variant"], r["head"], r["side"]): r for r in rows}
    fig, axes = plt.subplots(1, len(ISOTROPY_METRICS), figsize=(4.2 * len(ISOTROPY_METRICS), 3.8), squeeze=False)
    width = 0.8 / max(1, len(variants))
    x = np.arange(len(groups))
    for ax, (key, label) in zip(axes[0], ISOTROPY_METRICS):
        for i, variant in enumerate(variants):
            values = [lookup.get((variant, head, side), {}).get(key, np.nan) for head, side in groups]
            ax.bar(x + (i - (len(variants) - 1) / 2) * width, values, width, label=variant)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{head}\n{side}" for head, side in groups], fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[0, 0].legend(fontsize=7)
    return _save(fig, path)


def plot_intervals(bootstrap: Mapping[str, Mapping[str, Mapping[str, float]]], metric: str,
                   path: str | Path) -> Path:
    """Each run's mean ``metric`` with its bootstrap confidence interval (a forest plot)."""
    names = [name for name, rows in bootstrap.items() if metric in rows]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.5))
    for y, name in enumerate(names):
        row = bootstrap[name][metric]
        ax.errorbar(row["observed"], y, xerr=[[row["observed"] - row["low"]], [row["high"] - row["observed"]]],
                    fmt="o", capsize=4)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{metric} (bootstrap {100 * next(iter(bootstrap[names[0]].values()))['confidence']:.0f}% CI)"
                  if names else metric)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def plot_scatter(points: Sequence[tuple[str, float, float]], path: str | Path, *, xlabel: str, ylabel: str,
                 title: str = "") -> Path:
    """One labelled point per (label, x, y)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, x, y in points:
        ax.scatter([x], [y], s=30)
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot_groups(points: Sequence[tuple[str, str, float, float]], path: str | Path, *, xlabel: str, ylabel: str,
                title: str = "") -> Path:
    """Points (colour group, marker group, x, y): one colour per first group, one marker per second, both in a
    legend (many points stay readable where a label per point would not)."""
    colours = {group: f"C{i % 10}" for i, group in enumerate(dict.fromkeys(p[0] for p in points))}
    markers = {group: MARKERS[i % len(MARKERS)] for i, group in enumerate(dict.fromkeys(p[1] for p in points))}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for colour, marker, x, y in points:
        ax.scatter([x], [y], s=34, c=colours[colour], marker=markers[marker], alpha=0.85)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=g) for g, c in colours.items()]
    handles += [plt.Line2D([], [], color="grey", marker=m, linestyle="", label=g) for g, m in markers.items()]
    ax.legend(handles=handles, fontsize=7, loc="best", framealpha=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)
