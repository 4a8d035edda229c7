"""``spec-serve bench --plot FILE.png``: each ratio of a bench report, one dot per round.

matplotlib is an optional extra (``pip install 'spec-serve[plot]'``), imported only here.
"""

from __future__ import annotations

from typing import Any


def ratio_rounds(report: dict[str, Any]) -> list[tuple[str, list[float], float, float | None]]:
    """``(label, per-round values, median, H200 target)`` for every ratio the report could compute."""
    rows = []
    for ratio in report["ratios"]:
        if ratio["value"] is not None:
            values = [float(v) for v in ratio.get("rounds", [ratio["value"]])]
            rows.append((ratio["ratio"], values, float(ratio["value"]), ratio["h200_target"]))
    return rows


def plot_ratios(report: dict[str, Any], path: str) -> None:
    """Write a PNG: a row per ratio, a dot per round, a bar at the median, the H200 target as a tick."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; never opens a window
    import matplotlib.pyplot as plt

    rows = ratio_rounds(report)
    if not rows:
        raise ValueError("the report has no ratios to plot (choose scenarios that pair up, see RATIOS)")
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    try:
        for y, (_label, values, median, goal) in enumerate(rows):
            ax.scatter(values, [y] * len(values), s=18, color="tab:blue", zorder=3)
            ax.plot([median] * 2, [y - 0.3, y + 0.3], color="tab:blue", linewidth=2)
            if goal is not None:
                ax.plot([goal] * 2, [y - 0.35, y + 0.35], color="tab:red", linewidth=1, linestyle="--")
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_yticks(range(len(rows)), [row[0] for row in rows], fontsize=8)
        ax.invert_yaxis()
        rounds = max(len(row[1]) for row in rows)
        ax.set_xlabel("ratio (dots: rounds; bar: median; red dashes: H200 target)")
        ax.set_title(f"spec-serve bench, {rounds} round{'s' if rounds > 1 else ''}, {report.get('when', '')}",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)

