"""The figures of chapter "Time against the limit": the machine's matmul peak by size, each run's
MFU and HFU, and where a profiled step's time goes."""

from __future__ import annotations

from multigpu.plots.style import GREY, LIGHT, PALETTE, _figure, _stacked_bars

CATEGORY_COLORS = {"matmul": PALETTE[0], "attention": PALETTE[4], "communication": PALETTE[3],
                   "optimizer": PALETTE[2], "other operators": PALETTE[1], "outside operators": LIGHT}


def matmul_sweep(records, title="What a matrix product reaches here, by size", sheet: dict | None = None):
    """FLOP/s of n x n products by n (experiment machine_limits): one line per dtype (and CPU thread count), the
    datasheet's dense peak dashed: `sheet` (`experiments.limits.datasheet`), else the one the records name."""
    fig, (ax,) = _figure(records)
    series: dict = {}
    for r in records:
        if r["kind"] == "matmul":
            label = r["dtype"] + (f", {r['threads']} thread{'s' if r['threads'] > 1 else ''}" if r["threads"] else "")
            series.setdefault(label, []).append((r["n"], r["best_flops_per_s"], r["dtype"]))
    for i, (label, points) in enumerate(sorted(series.items())):
        points.sort()
        ax.plot([n for n, _, _ in points], [f / 1e9 for _, f, _ in points], "o-", color=PALETTE[i % len(PALETTE)],
                label=label)
    sheet = sheet or next((r["datasheet"] for r in records if r.get("datasheet")), None)
    for i, (label, _) in enumerate(sorted(series.items())):
        dtype = label.split(",")[0]
        if sheet and dtype in sheet:
            ax.axhline(sheet[dtype] / 1e9, color=PALETTE[i % len(PALETTE)], ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n (an n x n by n x n product)")
    ax.set_ylabel("GFLOP/s" + (" (dashed: the datasheet's)" if sheet else ""))
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def mfu_bars(rows: list[dict], records, title="Each run's share of the machine's measured peak"):
    """MFU and HFU per run (`rows`: {"run", "mfu", "hfu"}), the HFU's extra (recomputation) stacked on the MFU."""
    fig, (ax,) = _figure(records, height=max(3.0, 0.3 * len(rows) + 1.2))
    ys = range(len(rows))
    ax.barh(list(ys), [100 * r["mfu"] for r in rows], color=PALETTE[0], label="MFU (model FLOPs)")
    ax.barh(list(ys), [100 * (r["hfu"] - r["mfu"]) for r in rows], left=[100 * r["mfu"] for r in rows],
            color=GREY, label="HFU's extra (recomputation)")
    ax.set_yticks(list(ys), [r["run"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of the measured matmul peak of the devices the run used")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def step_breakdown(rows: list[dict], records, title="Where one step's time goes"):
    """One stacked bar per profiled run (`rows`: {"run", "seconds": {category: s}}), in shares of its step."""
    from multigpu.profiling import CATEGORIES

    fig, (ax,) = _figure(records)
    x = list(range(len(rows)))
    series = {c: [100 * r["seconds"][c] / sum(r["seconds"][k] for k in CATEGORIES) for r in rows]
              for c in CATEGORIES}
    _stacked_bars(ax, x, series, [CATEGORY_COLORS[c] for c in CATEGORIES])
    ax.set_xticks(x, [r["run"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of the profiled step")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def step_timelines(rows: list[dict], records, title="One profiled step, rank by rank"):
    """Per run and rank (`rows`: {"run", "timelines": one per rank, as multigpu.profiling.timeline}), a lane of
    when it computed and one of when it communicated, in milliseconds from the step's first operator."""
    lanes = [(row["run"], rank, kind, t[kind]) for row in rows for rank, t in enumerate(row["timelines"])
             for kind in ("compute", "communication")]
    fig, (ax,) = _figure(records, height=max(3.0, 0.22 * len(lanes) + 1.2))
    colors = {"compute": PALETTE[0], "communication": PALETTE[3]}
    for y, (_, _, kind, spans) in enumerate(lanes):
        ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for a, b in spans], (y - 0.4, 0.8), color=colors[kind],
                       label=kind if y < 2 else None)
    ax.set_yticks(range(len(lanes)), [f"{run}, rank {rank}: {kind}" for run, rank, kind, _ in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds from the step's first operator")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


RECOMPUTE_COLORS = {"none": PALETTE[0], "full": PALETTE[1], "selective": PALETTE[2]}


def recompute_bars(rows: list[dict], records, title="What a rank keeps for backward, by recomputation"):
    """Per configuration (`rows`: {"setting", "mode", "measured", "estimated"}, bytes per token of a rank's
    micro-batch), one bar per recomputation mode, measured, the estimator's answer marked on it."""
    fig, (ax,) = _figure(records)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    modes = [m for m in RECOMPUTE_COLORS if any(r["mode"] == m for r in rows)]
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        for r in rows:
            if r["mode"] != mode:
                continue
            x = settings.index(r["setting"]) + (i - (len(modes) - 1) / 2) * width
            ax.bar(x, r["measured"] / 2**10, width, color=RECOMPUTE_COLORS[mode],
                   label=mode if r["setting"] == settings[0] else None)
            ax.plot([x - width / 2, x + width / 2], [r["estimated"] / 2**10] * 2, color=GREY, lw=2,
                    label="estimated" if r["setting"] == settings[0] and i == 0 else None)
    ax.set_xticks(range(len(settings)), settings, fontsize=8)
    ax.set_ylabel("KiB kept per token, per rank")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
