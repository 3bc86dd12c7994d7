"""The estimator held against dry runs (`multigpu.dryrun`): at any world size, the formulas' model states,
activations and collectives beside what the strategy's own code made and issued on one rank.

A dry run is not the truth everywhere (no time, no NCCL, no allocator), but what a rank holds between steps
and which collectives it calls with how many bytes are decided by the strategy's code alone, so there the two
must agree: model states to the byte, the collectives' calls and bytes exactly, the activations within
`ACTIVATION_GOAL` (the estimator's are traced on one CPU process; the dry run's on the rank's own share).
"""

from __future__ import annotations

from collections import defaultdict

from multigpu.config import RunConfig
from multigpu.estimator.question import Setup

ACTIVATION_GOAL = 0.05  # relative
STATES = ("params", "grads", "optimizer")


def setup_for(cfg: RunConfig) -> Setup | None:
    """The estimator's question for a dry run's config (None: a strategy or option it does not model)."""
    from multigpu.estimator.accuracy import setup_of

    return setup_of({"config": cfg.to_dict(), "grid": cfg.grid.as_dict(),
                     "provenance": {"device_type": "cpu", "backend": "nccl"}}, against="tracker")


def rows(cfg: RunConfig, run) -> list[dict]:
    """One row per category: the estimate, the dry run's measurement, and whether they agree within the goal.
    Categories: params, grads, optimizer (bytes between steps); activations (the first micro-batch's at the end
    of its forward); and per collective kind its calls and its payload bytes in one step."""
    from multigpu.errors import ConfigError
    from multigpu.estimator.peak import forward_saved, model_states
    from multigpu.estimator.share import rank_shares
    from multigpu.estimator.step_time import collectives

    setup = setup_for(cfg)
    if setup is None:
        return []
    try:
        share = rank_shares(setup)[run.coords["pp"] if cfg.grid.pp > 1 else 0]
    except ConfigError:  # a model the estimator does not know (a Llama's config.json): the dry run alone
        return []
    out = []

    def row(category, estimate, measured, goal=0.0):
        diff = None if estimate is None or measured is None else measured - estimate
        rel = None if diff is None or not estimate else diff / estimate
        ok = None if measured is None else diff is not None and (diff == 0 or (rel is not None and abs(rel) <= goal))
        out.append({"strategy": cfg.strategy, "world_size": cfg.processes, "degrees": cfg.grid.as_dict(),
                    "role": run.role, "category": category, "estimate": estimate, "dry_run": measured,
                    "difference": diff, "relative": rel, "within_goal": ok})  # None: not measured

    states = model_states(setup, share)
    for c in STATES:
        row(c, states[c], run.model_states[c])
    # one micro-batch's, times those a pipeline's schedule holds at once on this rank
    estimated = None if share.activations is None else round(share.in_flight * forward_saved(setup, share,
                                                                                             run.micro_batch))
    row("activations", estimated, run.forward_saved, ACTIVATION_GOAL)
    planned = defaultdict(lambda: [0, 0.0])
    for t in collectives(setup, cfg.global_batch_size, run.coords["pp"]):
        planned[t.kind][0] += t.calls
        planned[t.kind][1] += t.payload_bytes
    measured = defaultdict(lambda: [0, 0])
    for c in run.collectives:
        kind = "send" if c["kind"] == "recv" else c["kind"]  # a pipeline's and a ring's receives pair its sends
        if c["kind"] != "recv":
            measured[kind][0] += c["calls"]
            measured[kind][1] += c["payload_bytes"]
    for kind in sorted(set(planned) | set(measured)):
        row(f"{kind} calls", planned[kind][0], measured[kind][0])
        row(f"{kind} bytes", round(planned[kind][1]), measured[kind][1])
    return out


# the strategies the estimator names whose package versions cannot dry-run (dryrun.CANNOT), and the ones that run
# the same collectives on the same shares in their place
STAND_INS = {"ddp": "ddp-scratch", "pp-gpipe": "pp-gpipe-scratch", "pp-1f1b": "pp-1f1b-scratch"}


def config_of(setup: Setup, global_batch: int) -> RunConfig:
    """The dry run of an estimator's plan (the advisor's): its strategy, or the stand-in that issues the same
    collectives, on its grid, at its batch; a plan no package strategy can dry-run is a ConfigError saying why."""
    from multigpu.config import DTYPES
    from multigpu.dryrun import CANNOT, plan
    from multigpu.errors import ConfigError

    strategy = STAND_INS.get(setup.strategy, setup.strategy)
    grid = setup.grid
    if strategy.endswith("-scratch") and strategy.startswith("pp-") and (grid.dp > 1 or grid.tp > 1):
        raise ConfigError(f"{setup.strategy} with dp or tp cannot be dry-run: {CANNOT[setup.strategy]}, and its "
                          "from-scratch stand-in takes no other degree")
    if setup.dtype not in DTYPES:
        raise ConfigError(f"{setup.dtype} is the estimator's accounting of DeepSpeed-style mixed precision; the "
                          f"package trains {', '.join(DTYPES)}, so a dry run cannot run it")
    return plan(strategy, setup.world_size, setup.model, tp=grid.tp, pp=grid.pp if strategy.startswith("pp-") else 1,
                cp=grid.cp, seq_len=setup.seq_len, dtype=setup.dtype, optimizer=setup.optimizer,
                activation_checkpointing=setup.activation_checkpointing, grad_accum_steps=setup.grad_accum_steps,
                global_batch_size=global_batch, bucket_cap_mb=setup.bucket_cap_mb,
                **({"ep": grid.ep} if strategy == "ep-scratch" else {}))


def report(cfg: RunConfig, runs) -> list[str]:
    """Lines of text: each dry-run rank's measurements beside the estimator's, and its collectives."""
    def mib(x):
        return f"{x / 2**20:,.2f} MiB"

    lines = []
    for run in runs:
        where = ", ".join(f"{k} {v}" for k, v in run.coords.items())
        lines.append(f"{run.role} (rank {run.rank}, {where}): dry run {run.seconds:.2f} s, this process's "
                     f"resident peak {run.max_rss_bytes / 2**30:.2f} GiB")
        lines.append(f"  {'':<22}{'estimator':>16}{'dry run':>16}  difference")
        for r in rows(cfg, run) or [{"category": c, "estimate": None, "dry_run": measured, "difference": None}
                                    for c, measured in [*run.model_states.items(), ("activations", run.forward_saved)]]:
            unit = (lambda x: f"{x:,}") if r["category"].endswith("calls") else mib
            shown = [unit(x) if x is not None else "-" for x in (r["estimate"], r["dry_run"], r["difference"])]
            lines.append(f"  {r['category']:<22}{shown[0]:>16}{shown[1]:>16}  {shown[2] if r['difference'] else ''}")
        for c in run.collectives:
            lines.append(f"  {c['kind']:<14} over {c['group_size']:>5} ranks: {c['calls']:>6,} calls, "
                         f"{mib(c['payload_bytes'])} handed in")
    return lines


def held(strategy: str, world_size: int, model: str, **options) -> list[dict]:
    """`rows` of every distinct role of one plan (`dryrun.plan`), dry-run here."""
    from multigpu.dryrun import dry_runs, plan

    cfg = plan(strategy, world_size, model, **options)
    return [r for run in dry_runs(cfg) for r in rows(cfg, run)]


def not_estimated(cfg) -> str:
    """Which of the strategy, its options or the model the estimator does not model, and why."""
    from multigpu.errors import ConfigError
    from multigpu.estimator.share import rank_shares

    if setup_for(cfg) is None:
        options = "".join(f" with {k} {v}" for k, v in cfg.extra.items() if k in ("wrap", "replicas"))
        grid = " x ".join(f"{k} {v}" for k, v in cfg.grid.as_dict().items())
        return f"the estimator does not model the strategy {cfg.strategy} on grid {grid}{options}"
    try:
        rank_shares(setup_for(cfg))
    except ConfigError as e:
        return f"the estimator does not model {cfg.model} so: {e}"
    return "the estimator has no row for this plan"
