"""The figures of chapter "ZeRO and FSDP": who holds what at each ZeRO stage, model states
and bytes sent measured against the formulas, and one step animated rank by rank."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt

from multigpu.plots.style import BACKGROUND, COLORS, GREY, PALETTE, MiB, _figure, _live_footer, _stacked_bars, style


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
