"""Every figure of the book, as a function of records.

Each function takes records (from `multigpu.records.load`) and returns a matplotlib
Figure whose footer names the machine, backend, devices and date that produced them.
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt

from multigpu.memory import CATEGORIES
from multigpu.records import caption

MiB = 2**20

# The one palette: seaborn's "deep" colours, in their order, for anything told apart by colour.
PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
BLUE, ORANGE, GREEN, RED, PURPLE, BROWN, PINK, GREY = PALETTE
# and the greys of text, backgrounds and of what is not one of the things told apart
INK = "#222222"  # dark text on a light cell
DARK = "#333333"  # a bar that is the reference: one device, DDP's step
MUTED = "#555555"  # footers
FAINT = "#777777"  # a remark inside a figure
SUM_GREY = "#BBBBBB"  # a value summed over ranks
LIGHT = "#CCCCCC"  # what is left of a step
PALE = "#DDDDDD"  # nothing fits
BACKGROUND = "#EEEEEE"  # an empty lane

COLORS = {"params": BLUE, "grads": ORANGE, "optimizer": GREEN, "activations": RED, "other": GREY}
STRATEGY_COLORS = {"single": DARK, "ddp": BLUE, "ddp-scratch": ORANGE}


def style() -> None:
    plt.rcParams.update({"figure.dpi": 110, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3, "font.size": 10, "legend.frameon": False})


def _footer(fig, text: str, y: float = -0.02, wrap: bool = False) -> None:
    """The line under a figure that says where its numbers come from."""
    fig.text(0.5, y, text, ha="center", va="top", fontsize=7.5, color=MUTED, wrap=wrap)


def _stacked_bars(ax, x, series: dict, colors) -> None:
    """One stacked bar at each x: `series` maps a legend label to one value per x, bottom
    first; `colors`, one colour per series, in the same order."""
    bottoms = [0.0] * len(x)
    for (label, values), color in zip(series.items(), colors):
        ax.bar(x, values, bottom=bottoms, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]


def _figure(records, ncols=1, width=6.4, height=3.6):
    style()
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), constrained_layout=True, squeeze=False)
    fig.get_layout_engine().set(h_pad=0.12)
    _footer(fig, caption(records), wrap=True)  # a caption can be longer than the figure is wide
    return fig, list(axes[0])


def memory_stacked(records, labels, title="Peak memory of rank 0, by category"):
    """One stacked bar per record: the categories alive at the moment of the peak."""
    fig, (ax,) = _figure(records)
    _stacked_bars(ax, labels, {cat: [r["peak_memory_bytes_by_rank"][0][cat] / MiB for r in records]
                               for cat in CATEGORIES}, [COLORS[cat] for cat in CATEGORIES])
    ax.set_ylabel("MiB at the peak")
    ax.set_title(title)
    ax.legend(ncols=len(CATEGORIES), fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.12))
    return fig


def memory_growth(records, x_of, xlabel, title):
    """Saved activations and the peak, as a batch or sequence dimension grows."""
    fig, (ax,) = _figure(records)
    rows = sorted(records, key=x_of)
    xs = [x_of(r) for r in rows]
    model_states = [sum(r["model_state_bytes_by_rank"][0].values()) / MiB for r in rows]
    ax.plot(xs, [r["saved_activation_bytes_by_rank"][0] / MiB for r in rows], "o-", color=COLORS["activations"],
            label="activations saved by forward")
    ax.plot(xs, model_states, "o-", color=COLORS["params"], label="model states (params + grads + optimizer)")
    ax.plot(xs, [r["peak_memory_bytes_by_rank"][0]["total"] / MiB for r in rows], "k--", label="peak total")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend()
    return fig


def scaling(records, title="DDP: step time and throughput as processes are added"):
    """Left: step time by world size; right: tokens per second. Per-process batch fixed."""
    fig, (ax_t, ax_s) = _figure(records, ncols=2, width=8.4)
    for strategy in ("ddp", "ddp-scratch"):
        rows = sorted((r for r in records if r["config"]["strategy"] == strategy),
                      key=lambda r: r["config"]["world_size"])
        ns = [r["config"]["world_size"] for r in rows]
        ax_t.plot(ns, [r["step_time_s"] * 1e3 for r in rows], "o-", label=strategy,
                  color=STRATEGY_COLORS[strategy])
        ax_s.plot(ns, [r["tokens_per_s"] for r in rows], "o-", label=strategy, color=STRATEGY_COLORS[strategy])
    single = [r for r in records if r["config"]["strategy"] == "single"]
    if single:
        ax_t.axhline(single[0]["step_time_s"] * 1e3, color="k", ls=":", label="single")
        ideal = [single[0]["tokens_per_s"] * n for n in ns]
        ax_s.plot(ns, ideal, "k:", label="single x N (ideal)")
    for ax in (ax_t, ax_s):
        ax.set_xlabel("processes (N)")
        ax.set_xticks(ns)
        ax.legend()
    ax_t.set_ylabel("step time (ms)")
    ax_s.set_ylabel("tokens per second (all processes)")
    fig.suptitle(title)
    return fig


def comm_vs_rule(records, title="Bytes each rank sends per step, measured and predicted"):
    """Per rank: the all-reduce payload (= gradient bytes), the ring's 2(N-1)/N of it, and,
    where measured, the bytes that really crossed the loopback interface."""
    fig, (ax,) = _figure(records)
    rows = sorted((r for r in records if r["config"]["world_size"] > 1 and r["config"]["strategy"] == "ddp"),
                  key=lambda r: r["config"]["world_size"])
    ns = [r["config"]["world_size"] for r in rows]
    payload = [r["comm_payload_bytes_per_step_by_rank"][0].get("all_reduce", 0) / MiB for r in rows]
    rule = [2 * (n - 1) / n * p for n, p in zip(ns, payload)]
    wire = [(r.get("loopback_bytes_per_step") or 0) / r["config"]["world_size"] / MiB for r in rows]
    width = 0.27
    pos = list(range(len(ns)))
    ax.bar([p - width for p in pos], payload, width, label="all-reduce payload (counted)", color=BLUE)
    ax.bar(pos, rule, width, label="ring rule: 2(N-1)/N x payload", color=ORANGE)
    if any(wire):
        ax.bar([p + width for p in pos], wire, width, label="sent over loopback / N (measured)", color=GREEN)
    ax.set_xticks(pos, [f"N = {n}" for n in ns])
    ax.set_ylabel("MiB per step, per rank")
    ax.set_ylim(0, 1.45 * max(rule + payload + wire))
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def buckets(records, title="Bucket size: all-reduce calls and step time (ddp-scratch)"):
    fig, (ax,) = _figure(records)
    rows = sorted(records, key=lambda r: r["config"]["bucket_cap_mb"])
    caps = [r["config"]["bucket_cap_mb"] for r in rows]
    ax.plot(caps, [r["step_time_s"] * 1e3 for r in rows], "o-", color=BLUE)
    for cap, r in zip(caps, rows):
        calls = r["comm_calls_per_step_by_rank"][0].get("all_reduce", 0)
        label = "1 all-reduce\n(after backward)" if calls == 1 else f"{calls} all-reduces"
        ax.annotate(label, (cap, r["step_time_s"] * 1e3),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title)
    return fig


def loss_curves(records, labels, title="Training loss"):
    fig, (ax,) = _figure(records)
    for r, label in zip(records, labels):
        style_kw = {"color": STRATEGY_COLORS.get(r["config"]["strategy"], None)}
        ls = "-" if r["config"]["strategy"] == "single" else "--"
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], ls, label=label, **style_kw)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(title)
    ax.legend()
    return fig


# -- collectives ---------------------------------------------------------------------------

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


def _live_footer(fig, processes: int, y: float) -> None:
    """The footer of a figure run live while the book was built: where it ran."""
    import torch

    from multigpu.records import cpu_name

    _footer(fig, f"Run live while this page was built: {processes} gloo processes on {cpu_name()}, "
                 f"torch {torch.__version__}.", y)


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


# -- DataParallel --------------------------------------------------------------------------

DP_PHASES = ("scatter", "replicate", "forward", "gather", "loss", "backward", "reduce")


def dp_phases(phase_ms: dict, ddp_ms: dict, records, title="Where a step's time goes: DP against DDP"):
    """phase_ms[N]: dp's median milliseconds per phase (plus 'update and the rest');
    ddp_ms[N]: DDP's step time at the same N and batch."""
    fig, (ax,) = _figure(records)
    colors = dict(zip((*DP_PHASES, "update and the rest"), [GREY, RED, BLUE, PINK, BROWN, GREEN, ORANGE, LIGHT]))
    ns = sorted(phase_ms)
    dp_at = [2.5 * i for i in range(len(ns))]  # DP's bar at each N, DDP's beside it
    phases = list(dict.fromkeys(phase for n in ns for phase in phase_ms[n]))
    _stacked_bars(ax, dp_at, {phase: [phase_ms[n].get(phase, 0.0) for n in ns] for phase in phases},
                  [colors[phase] for phase in phases])
    ax.bar([p + 1 for p in dp_at], [ddp_ms[n] for n in ns], color=DARK, label="DDP step")
    ax.set_xticks([p + d for p in dp_at for d in (0, 1)], [f"{who}\nN={n}" for n in ns for who in ("DP", "DDP")])
    ax.set_ylabel("ms per step")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return fig


def dp_memory(record, title="What each DP replica holds during a step"):
    fig, (ax,) = _figure([record])
    per = record["peak_memory_bytes_by_rank"]
    labels = ["primary (0)"] + [f"replica {i}" for i in range(1, len(per))]
    _stacked_bars(ax, labels, {cat: [m[cat] / MiB for m in per] for cat in CATEGORIES},
                  [COLORS[cat] for cat in CATEGORIES])
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def dp_threads(record, title="The replica threads in one step (DP from scratch)"):
    """Each replica thread's forward and backward, wall time (bar) and CPU time (dark part)."""
    fig, (ax,) = _figure([record])
    threads = record["strategy_report"]["threads_last_step"]
    t0 = min(t["start"] for phase in threads.values() for t in phase)
    for phase, color in (("forward", BLUE), ("backward", GREEN)):
        for i, t in enumerate(threads[phase]):
            start, wall = (t["start"] - t0) * 1e3, (t["end"] - t["start"]) * 1e3
            ax.barh(i, wall, left=start, color=color, alpha=0.35, label=f"{phase}: wall" if i == 0 else None)
            ax.barh(i, t["cpu"] * 1e3, left=start, color=color, height=0.35,
                    label=f"{phase}: CPU time of the thread" if i == 0 else None)
    ax.set_yticks(range(len(threads["forward"])), [f"replica {i}" for i in range(len(threads["forward"]))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the forward began")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    return fig


def max_batch(curves: dict, records, cap_label: str, title="Largest global batch under a memory cap"):
    """curves: label -> (world sizes, largest global batch)."""
    fig, (ax,) = _figure(records)
    for label, (ns, batches) in curves.items():
        ax.plot(ns, batches, "o-", label=label)
    ax.set_xlabel("devices (N)")
    ax.set_ylabel("largest global batch")
    ax.set_xticks(sorted({n for ns, _ in curves.values() for n in ns}))
    ax.set_title(f"{title} ({cap_label})")
    ax.legend(fontsize=8)
    return fig


# -- sharding ------------------------------------------------------------------------------

def zero_stages(n: int = 4, k: int = 8, title="Who holds what: model states per rank, ZeRO stages 0-3"):
    """A diagram from the formula (multigpu.memory.zero_model_states): for each stage, each
    rank's parameters, gradients and optimizer state; the dark part is what the rank keeps,
    the light outline what plain data parallelism would keep (fp32 with K bytes of optimizer
    state per parameter)."""
    from multigpu.memory import zero_model_states

    style()
    optimizer = {0: "sgd", 4: "sgd-momentum", 8: "adamw"}[k]
    fig, axes = plt.subplots(1, 4, figsize=(10, 3.2), sharey=True, constrained_layout=True)
    full = zero_model_states(1, 1, 0, optimizer)
    for stage, ax in enumerate(axes):
        held = zero_model_states(1, n, stage, optimizer)
        bottom_full = 0.0
        for cat in ("params", "grads", "optimizer"):
            ax.bar(range(n), [full[cat]] * n, bottom=bottom_full, color="none", edgecolor=COLORS[cat], lw=1)
            ax.bar(range(n), [held[cat]] * n, bottom=bottom_full, color=COLORS[cat],
                   label=cat if stage == 0 else None)
            bottom_full += full[cat]
        ax.set_xticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
        name = ["stage 0 (DDP)", "stage 1: P_os", "stage 2: P_os+g", "stage 3: P_os+g+p"][stage]
        ax.set_title(f"{name}\n{sum(held.values()):.2f} x Psi bytes per rank", fontsize=9)
    axes[0].set_ylabel("bytes per parameter (Psi = parameters)")
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8)
    fig.suptitle(f"{title} (N = {n}, fp32, K = {k})", fontsize=10)
    return fig


def model_states_vs_formula(rows, records, title="Model states per rank: measured against the ZeRO formula"):
    """rows: dicts with 'label', measured 'params'/'grads'/'optimizer' and the formula's
    'predicted' total (bytes). One stacked bar per row; a black tick marks the prediction."""
    fig, (ax,) = _figure(records, width=8, height=3.8)
    labels = [r["label"] for r in rows]
    states = ("params", "grads", "optimizer")
    _stacked_bars(ax, labels, {f"{cat} (measured)": [r[cat] / MiB for r in rows] for cat in states},
                  [COLORS[cat] for cat in states])
    ax.scatter(labels, [r["predicted"] / MiB for r in rows], marker="_", s=400, color="black", zorder=3,
               label="ZeRO formula")
    ax.set_ylabel("MiB per rank")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


def comm_by_strategy(rows, records, title="Bytes each rank sends per step, by collective"):
    """rows: dicts with 'label' and ring-rule bytes per kind; the dashed line is DDP's."""
    fig, (ax,) = _figure(records, width=8, height=3.8)
    kinds = sorted({k for r in rows for k in r["bytes"]})
    colors = dict(zip(("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"), PALETTE))
    _stacked_bars(ax, [r["label"] for r in rows], {kind: [r["bytes"].get(kind, 0) / MiB for r in rows]
                                                   for kind in kinds}, [colors.get(kind, GREY) for kind in kinds])
    ddp = next(sum(r["bytes"].values()) for r in rows if r["label"].startswith("ddp"))
    ax.axhline(ddp / MiB, color="black", ls="--", lw=1, label="DDP")
    ax.set_ylabel("MiB per step (ring rule)")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


def animation_html(anim) -> str:
    """A matplotlib animation as HTML with its player, for a chapter to show with `HTML(...)`.
    Matplotlib's player links Font Awesome 4 from a CDN for its button icons; the book's theme
    already serves Font Awesome with the site, so the link is dropped and the page needs no
    network."""
    return re.sub(r'<link rel="stylesheet"\s*href="https?://[^"]*font-awesome[^"]*">', "", anim.to_jshtml())


def zero_timeline(ranks: list[dict]):
    """An animation of one ZeRO step (multigpu.experiments.step_traces.zero_holdings, every rank's trace of one
    stage): for each rank, the model laid end to end, coloured where the rank holds its
    parameters, gradients and optimizer state after each event. Returns a matplotlib
    FuncAnimation (the figure is closed; show it with `HTML(animation_html(anim))`)."""
    from matplotlib.animation import FuncAnimation

    from multigpu.experiments.step_traces import held_bytes, union

    style()
    first, n = ranks[0], len(ranks)
    frames, length, per_element = first["frames"], first["length"], first["bytes_per_element"]
    lanes = ["params", "grads", "optimizer"]
    fig, axes = plt.subplots(n, 1, figsize=(9, 0.75 * n + 1.6), sharex=True)
    full_bytes = sum(per_element.values()) * length  # what every DDP rank holds

    def draw(k: int):
        for rank, ax in enumerate(axes):
            ax.clear()
            held = ranks[rank]["frames"][k]
            for y, cat in enumerate(reversed(lanes)):
                ax.broken_barh([(0, length)], (y - 0.4, 0.8), color=BACKGROUND)
                ax.broken_barh([(a, b - a) for a, b in union(held[cat])], (y - 0.4, 0.8), color=COLORS[cat])
            total = sum(held_bytes(ranks[rank], k).values())
            for name, start, end in first["units"]:
                ax.axvline(start, color="white", lw=1.5)
                if rank == 0 and end - start > 0.05 * length:
                    ax.text((start + end) / 2, 2.75, name, ha="center", va="bottom", fontsize=7)
            ax.set_yticks(range(3), list(reversed(lanes)), fontsize=7)
            ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center", fontsize=8, labelpad=42)
            ax.text(1.01, 0.5, f"{total / full_bytes:.0%} of\nDDP's bytes", transform=ax.transAxes,
                    fontsize=7, va="center")
            ax.set_xlim(0, length)
            ax.set_ylim(-0.5, 3.3 if rank == 0 else 2.5)
            ax.grid(False)
        axes[-1].set_xlabel("the model's parameters, end to end (flat buffers, padding included)")
        fig.suptitle(f"ZeRO stage {first['stage']} ({first['model']}, {n} ranks), event {k + 1}/{len(frames)}: "
                     f"{frames[k]['event']}", fontsize=9)

    fig.subplots_adjust(left=0.17, right=0.88, top=0.88, bottom=0.14, hspace=0.25)
    _live_footer(fig, n, y=0.03)
    animation = FuncAnimation(fig, draw, frames=len(frames), interval=1200)
    plt.close(fig)
    return animation



# -- the estimator ---------------------------------------------------------------------------

ESTIMATED_FOOTER = "estimated by multigpu.estimate: ZeRO formulas and activations traced on fake tensors; nothing ran"
ADVICE_COLORS = {"ddp": BLUE, "zero1": PURPLE, "zero2": GREEN, "fsdp": ORANGE, "does not fit": PALE}


def _estimated_figure(width=6.4, height=3.6):
    style()
    fig, ax = plt.subplots(figsize=(width, height), constrained_layout=True)
    fig.get_layout_engine().set(h_pad=0.12)
    _footer(fig, ESTIMATED_FOOTER)
    return fig, ax


def estimate_bars(per_rank: dict, memory_bytes: int | None = None, title="Estimated memory per GPU at the peak"):
    """per_rank: label -> {category: bytes}; a stacked bar per label, and the device's memory."""
    fig, ax = _estimated_figure(width=max(5.0, 1.1 * len(per_rank) + 2.5))
    labels = list(per_rank)
    _stacked_bars(ax, labels, {cat: [per_rank[k][cat] / 2**30 for k in labels] for cat in CATEGORIES},
                  [COLORS[cat] for cat in CATEGORIES])
    if memory_bytes:
        ax.axhline(memory_bytes / 2**30, color="black", lw=1, ls="--", label="device memory")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, ncol=3)
    return fig


def strategy_map(choice: dict, models: list[str], sizes: dict, batches: list[int], machine: str,
                 title="The cheapest strategy that fits"):
    """choice: (model, global batch) -> strategy (or "does not fit"); one row per model
    (sizes: model -> parameters), one column per global batch."""
    from matplotlib.patches import Patch

    fig, ax = _estimated_figure(width=7.2, height=0.45 * len(models) + 1.8)
    for i, model in enumerate(models):
        for j, batch in enumerate(batches):
            name = choice[(model, batch)]
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=ADVICE_COLORS[name], ec="white"))
            ax.text(j + 0.5, i + 0.5, name if name != "does not fit" else "-", ha="center", va="center",
                    fontsize=7)
    ax.set_xlim(0, len(batches))
    ax.set_ylim(0, len(models))
    ax.set_xticks([j + 0.5 for j in range(len(batches))], [str(b) for b in batches])
    ax.set_yticks([i + 0.5 for i in range(len(models))],
                  [f"{m} ({sizes[m] / 1e9:.2g}B)" for m in models], fontsize=8)
    ax.set_xlabel("global batch (samples per step)")
    ax.grid(False)
    ax.set_title(f"{title}: {machine}", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in ADVICE_COLORS.items()], fontsize=7, ncol=5,
              loc="upper center", bbox_to_anchor=(0.5, -0.22))
    return fig


def predicted_vs_measured(rows, records, title="The estimator against every recorded run"):
    """rows: multigpu.accuracy.against_records; measured peak total against the estimate."""
    fig, (ax,) = _figure(records)
    for strategy in sorted({r["strategy"] for r in rows}):
        mine = [r for r in rows if r["strategy"] == strategy]
        ax.scatter([r["measured"]["total"] / MiB for r in mine], [r["estimated"]["total"] / MiB for r in mine],
                   s=18, label=strategy)
    top = max(max(r["measured"]["total"], r["estimated"]["total"]) for r in rows) / MiB * 1.05
    ax.plot([0, top], [0, top], color="black", lw=0.8, label="estimate = measurement")
    ax.set_xlabel("measured peak, rank 0 (MiB)")
    ax.set_ylabel("estimated peak (MiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return fig


def beside(labels: list[str], series: dict[str, list[float]], records, ylabel: str, title: str):
    """Grouped bars: for each label, one bar per series (measured beside its formula or
    model), e.g. {"measured": [...], "alpha-beta model": [...]}."""
    fig, (ax,) = _figure(records)
    palette = [BLUE, ORANGE, GREEN, GREY]
    width = 0.8 / len(series)
    pos = list(range(len(labels)))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([p + (i - (len(series) - 1) / 2) * width for p in pos], values, width, label=name, color=palette[i])
    ax.set_xticks(pos, labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def tp_speedup_by_width(widths: list[int], measured: list[float], predicted: list[float], records,
                        title="Where tensor parallelism pays: one MLP on 2 ranks against 1"):
    """Speed-up of a tensor-parallel MLP over one rank, by width: measured, and as the
    alpha-beta model of the link predicts it (half the compute plus the collectives)."""
    fig, (ax,) = _figure(records)
    ax.plot(widths, measured, "o-", color=BLUE, label="measured")
    ax.plot(widths, predicted, "s--", color=ORANGE, label="predicted: compute / 2 + alpha-beta collectives")
    ax.axhline(2, color=GREY, lw=0.8, ls=":", label="ideal (2 ranks)")
    ax.axhline(1, color=RED, lw=0.8, ls=":", label="break-even")
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("width h of the MLP (h -> 4h -> h)")
    ax.set_ylabel("speed-up over one rank")
    ax.set_ylim(0, 2.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return fig


ACTION_COLORS = {"F": BLUE, "B": ORANGE, "W": GREEN}


def _timeline_clock(records) -> str:
    """What a pipeline timeline's times are, for its axis: nothing to add on a CPU (the host is
    the device); on a GPU the GPU's time only where every rank's log says it used CUDA events
    (the report's "clock"), else the host's, which saw kernels queued, not run."""
    if all(r.get("provenance", {}).get("device_type") != "cuda" for r in records):
        return ""
    clocks = {x.get("clock") for r in records for x in r.get("strategy_report_by_rank") or [r]}
    return " (GPU time: CUDA events)" if clocks == {"cuda-events"} else " (host clock: kernels queued, not GPU time)"


def pipeline_timeline(events_by_rank: list[list[dict]], starts_unix: list[float], records, title: str, ax=None):
    """One row per rank, one box per action (F forward, B backward, W weight gradient),
    labelled with its micro-batch; the gaps are the bubble. Ranks are lined up on the wall
    clock of their step's start (one machine: one clock). A rank holding two stages shows
    the second stage's boxes hatched."""
    if ax is None:
        fig, (ax,) = _figure(records, height=0.55 * len(events_by_rank) + 1.6)
    else:
        fig = ax.figure
    t0 = min(starts_unix)
    first_stage = [min((e["stage"] for e in events), default=0) for events in events_by_rank]
    for rank, (events, start) in enumerate(zip(events_by_rank, starts_unix)):
        for e in events:
            if e["action"] not in ACTION_COLORS:
                continue  # communication boxes: shown as gaps, the time a stage waits
            left = (start - t0 + e["start_s"]) * 1e3
            width = (e["end_s"] - e["start_s"]) * 1e3
            ax.barh(rank, width, left=left, height=0.8, color=ACTION_COLORS[e["action"]], edgecolor="white",
                    hatch="//" if e["stage"] != first_stage[rank] else None, linewidth=0.5)
            if width > 0:
                ax.text(left + width / 2, rank, str(e["micro"]), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(events_by_rank)), [f"rank {r}" for r in range(len(events_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms from the step's start{_timeline_clock(records)}")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ACTION_COLORS.values()]
    ax.legend(handles, ["forward", "backward", "weight gradient"], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.22), ncols=3)
    return fig


def bubble_vs_formula(rows: list[dict], formulas: dict, records, title="The bubble: measured against the formula"):
    """Measured bubble fraction (1 - ideal / step) against m, one line per schedule and p,
    with the formula's curve dashed. `formulas`: label -> function (p, m) -> fraction."""
    fig, axes = _figure(records, ncols=2, width=8.4, height=3.6)
    palette = [BLUE, ORANGE, GREEN, RED, PURPLE, GREY]
    for ax, p in zip(axes, (2, 4)):
        mine = [r for r in rows if r["p"] == p]
        for i, schedule in enumerate(dict.fromkeys(r["schedule"] for r in mine)):
            pts = sorted((r["m"], 1 - r["ideal_s"] / r["step_s"]) for r in mine if r["schedule"] == schedule)
            ax.plot(*zip(*pts), "o-", color=palette[i % len(palette)], label=schedule, ms=4)
        ms = sorted({r["m"] for r in mine})
        for j, (label, f) in enumerate(formulas.items()):
            ax.plot(ms, [f(p, m) for m in ms], ls="--", color="k", alpha=0.7 - 0.3 * j, lw=1, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches m")
        ax.set_title(f"p = {p} stages", fontsize=9)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("bubble: idle share of the step")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return fig


def rank_grid(sizes: dict[str, int], title="The rank grid: pp x dp x tp"):
    """A diagram of `runtime.RankGrid`: one panel per pipeline stage, each a dp x tp table
    of ranks (tp innermost: a row is one tensor-parallel group of consecutive ranks, a
    column one data-parallel group; the same cell in every panel is one pipeline). Drawn
    from the grid's own coordinates, not by hand."""
    from matplotlib.patches import Rectangle

    from multigpu.runtime import GRID_DIMS, RankGrid

    style()
    pp, dp, tp = (sizes[d] for d in GRID_DIMS)
    fig, axes = plt.subplots(1, pp, figsize=(2.2 * pp * max(1, tp / 2) + 0.6, 0.9 * dp + 1.2),
                             constrained_layout=True, squeeze=False)
    for rank in range(pp * dp * tp):
        grid = RankGrid(sizes, rank)
        s, d, t = (grid.coord(dim) for dim in GRID_DIMS)
        ax = axes[0][s]
        ax.add_patch(Rectangle((t, dp - 1 - d), 0.92, 0.88, color=PALETTE[s % len(PALETTE)], alpha=0.85))
        ax.text(t + 0.46, dp - 1 - d + 0.44, f"rank {rank}\n(dp {d}, tp {t})", ha="center", va="center",
                color="white", fontsize=8)
    for s, ax in enumerate(axes[0]):
        ax.set_xlim(-0.1, tp + 0.05)
        ax.set_ylim(-0.1, dp + 0.05)
        ax.set_xticks([i + 0.46 for i in range(tp)], [f"tp {i}" for i in range(tp)], fontsize=8)
        ax.set_yticks([dp - 1 - i + 0.44 for i in range(dp)], [f"dp {i}" for i in range(dp)], fontsize=8)
        ax.grid(False)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_title(f"pipeline stage {s}", fontsize=9)
    fig.suptitle(f"{title} = {pp} x {dp} x {tp}\na row is a TP group, a column a DP group, "
                 "the same cell across the panels a pipeline", fontsize=9)
    return fig


# -- the exact values under every figure shown in a chapter ---------------------------------
# A picture rounds: a reader of the site who wants a number off a bar or a line opens the
# table under the figure. The values are read back from what was drawn (bars, lines and
# points, labelled as in the legend, at the x the axis names), so every figure has one,
# whichever function drew it.

_TEX = {r"\Psi": "Ψ", r"\times": "×", r"\alpha": "α", r"\beta": "β", r"\approx": "≈", r"\cdot": "·"}


def _plain(text: str) -> str:
    """An axis label without matplotlib's $...$ mathtext (the page would show it as raw TeX)."""
    for tex, char in _TEX.items():
        text = text.replace(tex, char)
    return re.sub(r"[${}\\]", "", text).strip()


def _number(value) -> str:
    value = float(value)
    return f"{value:,.0f}" if value == int(value) and abs(value) < 1e15 else f"{value:,.6g}"


def _at(ax, axis: str, position: float) -> str:
    """A bar's or point's position as the axis names it: its label on an axis of named ticks
    (categories, or labels set by hand), else the number."""
    from matplotlib.category import StrCategoryFormatter
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    # categories, or labels set by hand (set_xticks(ticks, labels) installs a FuncFormatter)
    formatter = getattr(ax, f"{axis}axis").get_major_formatter()
    if isinstance(formatter, (FixedFormatter, FuncFormatter, StrCategoryFormatter)):
        # the nearest tick's: grouped bars sit beside their tick
        ticks = list(getattr(ax, f"get_{axis}ticks")())
        labels = [t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()]
        gap = min((b - a for a, b in zip(ticks, ticks[1:])), default=1.0)
        tick, label = min(zip(ticks, labels), key=lambda t: abs(t[0] - position), default=(None, ""))
        if label and abs(tick - position) < gap / 2:
            return _plain(label)
    return _number(position)


def figure_values(fig) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(axes title, header, rows)]: per axes, every bar, labelled line and labelled point set
    as rows of (series, position, value)."""
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer

    found = []
    for ax in fig.axes:
        rows = []
        horizontal = False
        for container in ax.containers:
            if not isinstance(container, BarContainer):
                continue
            horizontal = getattr(container, "orientation", "vertical") == "horizontal"
            for patch in container.patches:
                if horizontal:
                    at, value = _at(ax, "y", patch.get_y() + patch.get_height() / 2), patch.get_width()
                else:
                    at, value = _at(ax, "x", patch.get_x() + patch.get_width() / 2), patch.get_height()
                rows.append([_plain(container.get_label() or ""), at, _number(value)])
        for line in ax.get_lines():
            label, xs, ys = line.get_label(), line.get_xdata(), line.get_ydata()
            data = line.get_transform() == ax.transData
            if label.startswith("_"):  # not in the legend: kept where it is the axes' data line
                if not data or len(xs) < 2:
                    continue
                label = ""
            if not data and len(set(map(float, ys))) == 1:
                rows.append([_plain(label), "(a level)", _number(ys[0])])  # axhline
                continue
            rows += [[_plain(label), _at(ax, "x", x), _number(y)] for x, y in zip(xs, ys)]
        for points in ax.collections:
            label = points.get_label()
            if isinstance(points, PathCollection) and not label.startswith("_"):
                rows += [[_plain(label), _at(ax, "x", x), _number(y)] for x, y in points.get_offsets()]
        if rows:
            where = _plain((ax.get_ylabel() if horizontal else ax.get_xlabel()) or "at")
            value = _plain((ax.get_xlabel() if horizontal else ax.get_ylabel()) or "value")
            found.append((_plain(ax.get_title()), ["series", where, value], rows))
    return found


def _wide(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """(series, position, value) rows as one row per position and a column per series, where
    no series has two values at one position; else as they are."""
    cells = {(series, at): value for series, at, value in rows}
    if len(cells) < len(rows):
        return header, rows
    series = list(dict.fromkeys(r[0] for r in rows))
    positions = list(dict.fromkeys(r[1] for r in rows))
    return ([header[1], *(s or header[2] for s in series)],
            [[at, *(cells.get((s, at), "") for s in series)] for at in positions])


def figure_values_html(fig) -> str:
    """The figure's values as tables in a closed <details>, or '' if it draws none."""
    from html import escape

    tables = figure_values(fig)
    if not tables:
        return ""
    parts = ['<details class="figure-values"><summary>The values in this figure</summary>']
    for title, header, rows in tables:
        unit = header[2]
        header, rows = _wide(header, rows)
        caption = ": ".join(filter(None, [title, f"values in {unit}" if unit != "value" else ""]))
        parts.append("<table>" + (f"<caption>{escape(caption)}</caption>" if caption else ""))
        parts.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</table>")
    return "".join(parts) + "</details>"


def _show_with_values() -> None:
    """Run after each notebook cell, before the inline backend shows the cell's figures: shows
    each, then its values, and closes it (so the backend shows it once, as it would have)."""
    from IPython.display import HTML, display

    for number in plt.get_fignums():
        fig = plt.figure(number)
        display(fig)
        html = figure_values_html(fig)
        if html:
            display(HTML(html))
        plt.close(fig)


def _in_notebooks() -> None:
    """In a notebook kernel drawing inline (a chapter), every figure comes with its values."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or "inline" not in plt.get_backend():
        return
    callbacks = shell.events.callbacks["post_execute"]
    if _show_with_values not in callbacks:
        callbacks.insert(0, _show_with_values)


_in_notebooks()


# -- a run drawn as it goes, in a notebook ------------------------------------------------------


class LiveRun:
    """A run started from a notebook: its loss, step time and each step's peak memory on rank 0,
    drawn as each step arrives (at most twice a second), left in the cell when it ends."""

    def __init__(self, steps: int, title: str, redraw_s: float = 0.5):
        from IPython.display import display

        style()
        self.steps, self.title, self.redraw_s = steps, title, redraw_s
        self.rows: list[tuple[int, float, float, float | None]] = []
        self.fig, self.axes = plt.subplots(1, 3, figsize=(9, 2.4), constrained_layout=True)
        self.drawn_at = 0.0
        self._draw()
        self.handle = display(self.fig, display_id=True)

    def update(self, done: int, loss: float, step_s: float, peak_bytes: float | None) -> None:
        import time

        self.rows.append((done, loss, step_s * 1e3, None if peak_bytes is None or peak_bytes < 0
                          else peak_bytes / 2**30))
        if time.monotonic() - self.drawn_at >= self.redraw_s or done == self.steps:
            self._draw()
            self.handle.update(self.fig)

    def _draw(self) -> None:
        import time

        self.drawn_at = time.monotonic()
        steps = [r[0] for r in self.rows]
        labels = ("loss (rank 0's samples)", "step time (ms)", "the step's peak (GiB)")
        for ax, i, label in zip(self.axes, (1, 2, 3), labels):
            ax.clear()
            points = [(s, r[i]) for s, r in zip(steps, self.rows) if r[i] is not None]
            if points:
                ax.plot(*zip(*points), color=PALETTE[i - 1], marker="." if len(points) < 30 else None)
            ax.set_xlim(0.5, max(self.steps, 1) + 0.5)
            ax.set_xlabel("step")
            ax.set_title(label, fontsize=9)
        done = steps[-1] if steps else 0
        self.fig.suptitle(f"{self.title}: step {done} of {self.steps} (memory: rank 0's process above its size "
                          "before the model, as the machine counts it)", fontsize=9)

    def close(self) -> None:
        """The last state stays in the cell; the figure is closed so it is not shown twice."""
        self._draw()
        self.handle.update(self.fig)
        plt.close(self.fig)
