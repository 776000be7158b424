"""Drawing the merged timeline, ``timeline.png`` (matplotlib, the ``trace`` extra): one row per
rank, the kit's calls and waits as bars coloured by kind, torch's collectives as thin marks
under them (an open one, a run stuck in it, drawn up to the last time the rank wrote its file),
an x where a lost rank's file ends, a dashed line where the kit named a straggler; the axis in
seconds from the run's start. The merge (:mod:`._merge`) hands over the ranks' traces and waits
on rank 0's clock.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Tuple

__all__ = ["draw"]


def _draw_rank(ax: Any, tr: Any, base: int, end: float, colours: Dict[str, str]) -> None:
    """Draw one rank's row of ``timeline.png``: its spans, their labels where they are wide
    enough (``end``: the timeline's length in seconds), and an x where a lost rank died."""
    y = tr.rank
    # one collection per kind (a run may hold millions of spans): block bodies first,
    # then kit calls and waits, user spans (thinner) on top
    bars: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
    for span in tr.spans:
        start, width = (tr.at(span["t"]) - base) / 1e9, max(span["d"] / 1e9, 1e-4)
        bars[span["k"]].append((start, width))
        _name(ax, span, start, width, y, end, colours)
    for kind in ("body", "helper", "wait", "user"):
        if bars.get(kind):
            height = 0.4 if kind == "user" else 0.7
            ax.broken_barh(bars[kind], (y - height / 2, height), facecolors=colours[kind],
                           hatch="///" if kind == "wait" else None, edgecolor="white",
                           linewidth=0.5)
    for kind in ("torch", "torch-open"):  # a thin row of their own under the kit's
        if bars.get(kind):
            ax.broken_barh(bars[kind], (y + 0.2, 0.14), facecolors=colours[kind],
                           edgecolor=colours[kind], linewidth=0.8)
    if tr.end is None:
        ax.plot([(tr.at(tr.last) - base) / 1e9], [y], marker="x", color="black", markersize=10)


def _name(ax: Any, span: Dict[str, Any], start: float, width: float, y: int, end: float,
          colours: Dict[str, str]) -> None:
    """Label a span of row ``y`` where it is wide enough; a collective not finished always."""
    kind = span["k"]
    if kind == "finding":  # the kit's finding (a straggler): a line across every rank
        ax.axvline(start, color=colours["torch-open"], linestyle="--", linewidth=0.8)
        ax.text(start, -0.55, span["n"].split(" arrived")[0], ha="right", va="bottom",
                fontsize=7, color=colours["torch-open"], clip_on=True)
    elif kind == "torch-open":  # what the rank is stuck in
        ax.text(start + width, y + 0.48, f"{span['n']}: not finished", ha="right",
                va="center", fontsize=7, color=colours[kind], clip_on=True)
    elif width > 0.06 * end and kind != "torch":
        label = span["n"] if kind != "wait" else f"wait: {span['n']}"
        if kind == "body":  # above the bar: what runs inside is labelled on it
            ax.text(start, y - 0.38, f"{label} (body)", ha="left", va="bottom",
                    fontsize=7, clip_on=True)
        else:
            ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=7,
                    clip_on=True, zorder=5)


def draw(traces: List[Any], waits: List[Any], base: int, path: str) -> str:
    """``timeline.png``: ranks on the y axis, spans coloured by kind, waits hatched
    (``traces``: the merge's ``RankTrace`` objects; ``waits``: its waits).

    :raises ImportError: without matplotlib (the ``trace`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    colours = {"helper": "#4c78a8", "body": "#f58518", "user": "#54a24b", "wait": "#e45756",
               "torch": "#7f7f7f", "torch-open": "#b00020"}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(traces)))
    end = max((tr.at(tr.last) - base) / 1e9 for tr in traces) or 1e-3
    for tr in traces:
        _draw_rank(ax, tr, base, end, colours)
    computed: Dict[int, List[Tuple[float, float]]] = defaultdict(list)
    for w in waits:
        if w.computed:
            computed[w.rank].append(((w.start - base) / 1e9, (w.end - w.start) / 1e9))
    for rank, spans in computed.items():
        ax.broken_barh(spans, (rank - 0.35, 0.7), facecolors="none", hatch="///",
                       edgecolor=colours["wait"])
    ax.set_yticks([tr.rank for tr in traces])
    ax.set_yticklabels([f"rank {tr.rank}" for tr in traces])
    ax.set_ylim(max(tr.rank for tr in traces) + 0.6, -0.8)  # rank 0 on top, room for labels
    ax.set_xlim(0, end * 1.02)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)  # seconds, never 1e-5 + x
    ax.set_xlabel("seconds from the run's start (rank 0's clock)")
    ax.set_title("axolotl_dist timeline: kit calls and waits per rank")
    ax.legend(handles=[Patch(facecolor=colours["helper"], label="collective / helper"),
                       Patch(facecolor=colours["body"], label="block body (runs first)"),
                       Patch(facecolor="white", edgecolor=colours["wait"], hatch="///",
                             label="waiting for other ranks"),
                       Patch(facecolor=colours["user"], label="trace_span"),
                       Patch(facecolor=colours["torch"], label="torch collective"),
                       Patch(facecolor=colours["torch-open"], label="not finished")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(traces) < 4 else -0.12),
              ncol=3, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
