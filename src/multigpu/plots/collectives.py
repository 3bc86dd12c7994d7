"""The figures of chapter "Collectives": what every rank holds before and after each
collective, each all-reduce's bus bandwidth and bytes sent per rank, and stale gradients."""

from __future__ import annotations

import matplotlib.pyplot as plt

from multigpu.plots.style import BLUE, FAINT, INK, ORANGE, PALETTE, RED, SUM_GREY, MiB, _figure, _live_footer, style


def collective_grid(rows_by_rank, title="Each collective on 4 processes: what every rank holds"):
    """`rows_by_rank`: what `multigpu.collectives.demo` returned on each rank (live, not
    recorded). One row per collective; every rank's tensor before and after, each value
    coloured by the rank it came from (grey: a sum over all ranks)."""
    style()
    n = len(rows_by_rank)
    names = [row["collective"] for row in rows_by_rank[0]]

    def origin(value):  # rank r starts with 10(r+1) + c; anything larger is a sum
        return value // 10 - 1 if 10 <= value < 10 * (n + 1) and value % 10 < n else None

    fig, axes = plt.subplots(len(names), 2, figsize=(7.2, 0.42 * n * len(names) + 0.6), constrained_layout=True)
    for i, name in enumerate(names):
        for j, when in enumerate(("before", "after")):
            ax = axes[i][j]
            ax.set_xlim(0, n)
            ax.set_ylim(n, 0)
            ax.axis("off")
            for rank in range(n):
                values = rows_by_rank[rank][i][when]
                ax.text(-0.1, rank + 0.5, f"rank {rank}", ha="right", va="center", fontsize=7.5)
                for c, v in enumerate(values or []):
                    src = origin(v)
                    ax.add_patch(plt.Rectangle((c + 0.05, rank + 0.1), 0.9, 0.8,
                                               color=PALETTE[src % len(PALETTE)] if src is not None else SUM_GREY,
                                               alpha=0.85))
                    ax.text(c + 0.5, rank + 0.5, str(v), ha="center", va="center", fontsize=7.5,
                            color="white" if src is not None else INK)
                if values is None:
                    ax.text(0.05, rank + 0.5, "(undefined)", va="center", fontsize=7.5, color=FAINT)
            ax.set_title(f"{name}: {when}" if j == 0 else when, fontsize=9, loc="left")
    fig.suptitle(title, fontsize=10)
    _live_footer(fig, n, y=-0.01)
    return fig


def collective_bandwidth(records, title="All-reduce bus bandwidth by message size"):
    """Bus bandwidth (algorithm bandwidth x 2(N-1)/N) against message size, one panel per N."""
    sizes_n = sorted({r["world_size"] for r in records})
    fig, axes = _figure(records, ncols=len(sizes_n), width=4.2 * len(sizes_n), height=3.6)
    for ax, n in zip(axes, sizes_n):
        for name in ("naive", "parameter server", "ring", "library"):
            rows = sorted((r for r in records if r["world_size"] == n and r["algorithm"] == name),
                          key=lambda r: r["size_bytes"])
            ax.plot([r["size_bytes"] / MiB for r in rows], [r["busbw_bytes_per_s"] / 1e9 for r in rows],
                    "o-", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ticks = [2**k for k in range(-8, 9, 2)]
        ax.set_xticks(ticks, [f"{int(t * 1024)} KiB" if t < 1 else f"{int(t)} MiB" for t in ticks],
                      rotation=45, fontsize=7)
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"N = {n} processes", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def bytes_per_rank(records, title="Bytes each rank sends for one all-reduce"):
    """Counted bytes per rank (as a multiple of the data) for each algorithm, at one size."""
    sizes_n = sorted({r["world_size"] for r in records})
    fig, axes = _figure(records, ncols=len(sizes_n), width=4.2 * len(sizes_n), height=3.4)
    names = ["naive", "parameter server", "ring"]
    for ax, n in zip(axes, sizes_n):
        width = 0.8 / n
        for k, name in enumerate(names):
            (r,) = [r for r in records if r["world_size"] == n and r["algorithm"] == name]
            for rank, sent in enumerate(r["sent_bytes_by_rank"]):
                ax.bar(k + (rank - (n - 1) / 2) * width, sent / r["size_bytes"], width * 0.9,
                       color=[RED, BLUE][rank > 0] if name == "parameter server" else BLUE)
        ax.axhline(2 * (n - 1) / n, color=ORANGE, ls="--", lw=1, label="ring rule 2(N-1)/N")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("bytes sent / data size")
        ax.set_title(f"N = {n} (one bar per rank; red: the server)", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def staleness(records, title="Stale gradients: SGD with updates applied late"):
    fig, (ax,) = _figure(records)
    for r in sorted(records, key=lambda r: r["delay"]):
        label = "synchronous (delay 0)" if r["delay"] == 0 else f"{r['delay']} updates stale"
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=label, lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss of the current weights")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
