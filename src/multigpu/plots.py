"""Every figure of the book, as a function of records.

Each function takes records (from `multigpu.records.load`) and returns a matplotlib
Figure whose footer names the machine, backend, devices and date that produced them.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from multigpu.memory import CATEGORIES
from multigpu.records import caption

MiB = 2**20
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52", "other": "#8C8C8C"}
STRATEGY_COLORS = {"single": "#333333", "ddp": "#4C72B0", "ddp-scratch": "#DD8452"}


def style() -> None:
    plt.rcParams.update({"figure.dpi": 110, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3, "font.size": 10, "legend.frameon": False})


def _figure(records, ncols=1, width=6.4, height=3.6):
    style()
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), constrained_layout=True, squeeze=False)
    fig.get_layout_engine().set(h_pad=0.12)
    fig.text(0.5, -0.02, caption(records), ha="center", va="top", fontsize=7.5, color="#555555", wrap=True)
    return fig, list(axes[0])


def memory_stacked(records, labels, title="Peak memory of rank 0, by category"):
    """One stacked bar per record: the categories alive at the moment of the peak."""
    fig, (ax,) = _figure(records)
    bottoms = [0.0] * len(records)
    for cat in CATEGORIES:
        values = [r["peak_memory_bytes_by_rank"][0][cat] / MiB for r in records]
        ax.bar(labels, values, bottom=bottoms, label=cat, color=COLORS[cat])
        bottoms = [b + v for b, v in zip(bottoms, values)]
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
    ax.bar([p - width for p in pos], payload, width, label="all-reduce payload (counted)", color="#4C72B0")
    ax.bar(pos, rule, width, label="ring rule: 2(N-1)/N x payload", color="#DD8452")
    if any(wire):
        ax.bar([p + width for p in pos], wire, width, label="sent over loopback / N (measured)", color="#55A868")
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
    ax.plot(caps, [r["step_time_s"] * 1e3 for r in rows], "o-", color="#4C72B0")
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
