"""The figures of chapters "DDP" and "DataParallel": step time and throughput as processes are
added, the bytes of the all-reduce against the ring rule, buckets, loss curves, and where a
DataParallel step's time and memory go."""

from __future__ import annotations

from multigpu.memory import CATEGORIES
from multigpu.plots.style import (
    BLUE,
    BROWN,
    COLORS,
    DARK,
    GREEN,
    GREY,
    LIGHT,
    ORANGE,
    PINK,
    RED,
    STRATEGY_COLORS,
    MiB,
    _figure,
    _stacked_bars,
)


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
    """Each replica's bytes by category, stacked; on GPUs (torch.nn.DataParallel, categories
    None) each device's allocator peak, one bar that says it is not split."""
    fig, (ax,) = _figure([record])
    per = record["peak_memory_bytes_by_rank"]
    labels = ["primary (0)"] + [f"replica {i}" for i in range(1, len(per))]
    if any(m[cat] is None for m in per for cat in CATEGORIES):
        _stacked_bars(ax, labels, {"allocator's peak (not split by category)": [m["total"] / MiB for m in per]},
                      [DARK])
    else:
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
