"""The timeline of a run (``ckpt goodput --plot``): each start a bar, its saves as ticks, failures and
the work they lost marked. :func:`plot` draws it with matplotlib (``pip install ckpt[plot]``);
:func:`terminal_chart` is the same picture in text, for a terminal without it."""

from __future__ import annotations

import os

from .goodput import Goodput

# what a cell of a start's bar shows, in the order a cell shared by two of them takes the later
RESTART, KEPT, LOST, SAVE, FAILED = "·", "█", "x", "|", "✗"
LEGEND = f"{RESTART} start-up and load   {KEPT} training kept   {SAVE} save   {LOST} work lost   {FAILED} failure"


def span_text(s: float | None) -> str:
    """A length of time as the goodput table and chart show it: ``42.0s``, ``3.5min``, ``2.1h``; ``-`` for None."""
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}min"
    return f"{s / 3600:.1f}h"


def terminal_chart(g: Goodput, width: int = 80) -> list[str]:
    """The timeline in lines of at most ``width`` characters: one row per start over a common time
    axis, then the axis and a legend."""
    if not g.starts:
        return ["(the journal holds no start)"]
    label_w = len(f"#{len(g.starts)} ")
    cols = max(10, width - label_w - 1)  # one more column for a failure's mark
    t0, span = g.starts[0].begin, max(g.wall_s, 1e-9)

    def col(t: float) -> int:
        return min(cols - 1, max(0, int((t - t0) / span * cols)))

    lines = []
    for s in g.starts:
        row = [" "] * (cols + 1)
        for what, a, b in ((RESTART, s.begin, s.ready), (KEPT, s.ready, s.kept_until), (LOST, s.kept_until, s.end)):
            if b > a:
                for c in range(col(a), col(b) + 1 if b == s.end else max(col(a) + 1, col(b))):
                    row[c] = what
        for _, t in s.saves:
            row[col(t)] = SAVE
        if s.ended == "failed":
            row[col(s.end) + 1] = FAILED
        lines.append(f"#{s.index}".ljust(label_w) + "".join(row).rstrip())
    end = span_text(g.wall_s)
    lines.append(" " * label_w + "0" + end.rjust(cols - 1))
    lines.append(LEGEND)
    return lines


def plot(g: Goodput, path: str | os.PathLike) -> None:
    """Draw the timeline into ``path`` (a .png, or any format matplotlib writes); raises ImportError
    without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.45 * max(1, len(g.starts))))
    t0 = g.starts[0].begin if g.starts else 0.0
    for s in g.starts:
        y = s.index
        ax.broken_barh([(s.begin - t0, s.ready - s.begin)], (y - 0.3, 0.6), color="#bbbbbb")
        ax.broken_barh([(s.ready - t0, s.kept_until - s.ready)], (y - 0.3, 0.6), color="#3a7bd5")
        if s.end > s.kept_until:
            ax.broken_barh([(s.kept_until - t0, s.end - s.kept_until)], (y - 0.3, 0.6), color="#e4572e",
                           hatch="//")
        for _, t in s.saves:
            ax.plot([t - t0, t - t0], [y - 0.35, y + 0.35], color="black", linewidth=0.8)
        if s.ended == "failed":
            ax.plot([s.end - t0], [y], marker="x", color="#c00000", markersize=9, mew=2)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#bbbbbb", label="start-up and load"), Patch(color="#3a7bd5", label="training kept"),
                       Patch(color="#e4572e", label="work lost"), Line2D([], [], color="black", label="save"),
                       Line2D([], [], color="#c00000", marker="x", linestyle="", label="failure")],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False, fontsize="small")
    ax.set_yticks([s.index for s in g.starts], [f"start {s.index}" for s in g.starts])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first start")
    mtbf = span_text(g.mtbf_s)
    ax.set_title(f"goodput {g.share(g.good_s):.1f}%: {len(g.failures)} failure(s), MTBF observed {mtbf}; "
                 f"stall {g.share(g.stall_s):.1f}%, lost {g.share(g.lost_s):.1f}%, "
                 f"restart/load {g.share(g.restart_s):.1f}%")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)
