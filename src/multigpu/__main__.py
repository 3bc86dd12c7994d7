"""Command line: python -m multigpu {run, check, figures} ...

    python -m multigpu run --strategy ddp --world-size 2 --model gpt-tiny --steps 20 [--json]
    python -m multigpu check --strategy ddp-scratch --world-size 4 [--json]
    python -m multigpu figures [--experiments NAME ...]
    python -m multigpu dryrun --strategy fsdp --tp 8 --world-size 1024 --model configs/llama3-70b.json
    python -m multigpu estimate --model t5-large --strategy fsdp --world-size 4 --gpu-memory 32GiB --max-batch
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from multigpu.config import OPTIMIZERS, STRATEGIES, ConfigError, RunConfig, with_strategy_defaults
from multigpu.estimator.cli import add_estimator_commands


def _add_run_options(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--strategy", default=d.strategy, help=f"one of: {', '.join(STRATEGIES)}")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: 1 for single, 2 otherwise)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree, with a data-parallel strategy")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree, with a data-parallel strategy")
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel degree: ranks that split every sequence "
                   "(cp-scratch, or fsdp with --cp)")
    p.add_argument("--cp-attention", default=None, help="context parallelism's attention: ring (default), allgather "
                   "or ulysses")
    p.add_argument("--cp-balance", default=None, help="which tokens each cp rank holds: zigzag (default; balanced "
                   "under the causal mask) or contiguous")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (ep-scratch): data-parallel ranks "
                   "that split a mixture of experts' experts (default: all of them; 1: plain data parallel)")
    p.add_argument("--top-k", type=int, default=None, help="mixture of experts: experts per token (the model's: 2)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="mixture of experts: places per expert, as a multiple of an even share (default: no limit)")
    p.add_argument("--aux-loss-coef", type=float, default=None,
                   help="mixture of experts: weight of the load-balancing loss (default 0.01, Switch's)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree (default: what --world-size leaves after --tp, --pp and --cp)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="tensor parallelism: also split the sequence between the blocks (Korthikanti et al.)")
    p.add_argument("--hsdp-replicas", type=int, default=None,
                   help="fsdp: hybrid sharding, the data-parallel ranks cut into this many groups that each "
                        "shard the model and replicate each other (shard inside a node, replicate across)")
    p.add_argument("--model", default=None, help=f"model preset (gpt-tiny, gpt2, t5-small, ...) or a Hugging Face "
                   f"config.json (default: {d.model}, or a deeper gpt-* where a pipeline needs a block per stage)")
    p.add_argument("--global-batch-size", "--batch-size", type=int, default=d.global_batch_size,
                   help="samples per optimizer step, all processes together")
    p.add_argument("--per-rank-batch-size", type=int, default=None,
                   help="samples per optimizer step on each process (sets the global batch to N times it)")
    p.add_argument("--grad-accum-steps", "--micro-batches", type=int, default=None,
                   help=f"micro-batches per optimizer step, a pipeline schedule's m (default: {d.grad_accum_steps}, "
                        "or the fewest the pipeline's schedule takes)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--dtype", default=d.dtype, help="fp32, bf16-mixed (autocast) or fp16-mixed (autocast with loss "
                   "scaling; single, ddp and dp)")
    p.add_argument("--optimizer", default=d.optimizer, help=", ".join(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--activation-checkpointing", nargs="?", const=True, default=False,
                   choices=(True, "full", "selective"), metavar="full|selective",
                   help="recompute each block's activations in backward: all of them (full, the default) or all "
                        "but the matrix products' and attention's outputs (selective)")
    p.add_argument("--dataset", default=d.dataset, help="synthetic (learnable) or dummy (random ids)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--profile", nargs="?", const=True, default=None, metavar="FOLDER",
                   help="run the last step under torch's profiler: its time by category and, with a FOLDER (a "
                        "relative one under results/<machine>/), each rank's trace for Perfetto")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")


def _config(args, on_this_machine: bool = True) -> RunConfig:
    world_size = args.world_size if args.world_size is not None else (1 if args.strategy == "single" else 2)
    extra = {"sequence_parallel": True} if args.sequence_parallel else {}
    if args.hsdp_replicas is not None:
        if args.strategy != "fsdp":
            raise ConfigError(f"--hsdp-replicas is hybrid sharding, an fsdp option; got --strategy {args.strategy}")
        extra["replicas"] = args.hsdp_replicas
    for name in ("cp_attention", "cp_balance"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    for name in ("top_k", "capacity_factor", "aux_loss_coef"):
        if getattr(args, name) is not None:
            extra[f"moe_{name}"] = getattr(args, name)
    if getattr(args, "profile", None):
        extra["profile"] = args.profile
    d = RunConfig()
    cfg = RunConfig(strategy=args.strategy, world_size=world_size, tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp,
                    ep=args.ep, model=args.model or d.model, extra=extra)
    global_batch_size = args.global_batch_size
    if args.per_rank_batch_size is not None:
        if args.per_rank_batch_size < 1:
            raise ConfigError(f"--per-rank-batch-size must be >= 1, got {args.per_rank_batch_size}")
        if cfg.strategy in STRATEGIES:
            global_batch_size = args.per_rank_batch_size * cfg.grid.dp  # the grid, checked
    cfg = cfg.replace(  # (a number given is checked as given: 0 is refused, not replaced by a default)
        global_batch_size=1 if global_batch_size is None else global_batch_size,
        grad_accum_steps=d.grad_accum_steps if args.grad_accum_steps is None else args.grad_accum_steps,
        seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr, steps=args.steps,
        activation_checkpointing=args.activation_checkpointing, dataset=args.dataset, seed=args.seed,
        device=args.device, bucket_cap_mb=args.bucket_cap_mb, threads_per_worker=args.threads_per_worker,
        **{name: getattr(args, name) for name in ("dataset_size", "checkpoint_dir", "checkpoint_every",
                                                  "checkpoint_keep", "checkpoint_async", "resume")
           if hasattr(args, name)},
    )
    if cfg.strategy in STRATEGIES:  # what the strategy needs and the defaults do not give, said
        chosen = {name for name in ("model", "grad_accum_steps") if getattr(args, name) is not None}
        cfg, notes = with_strategy_defaults(cfg, chosen)
        for note in notes:
            print(f"multigpu: {note}", file=sys.stderr)
    if global_batch_size is None:  # dryrun's default: one sample per data-parallel rank and micro-batch
        cfg = cfg.replace(global_batch_size=cfg.grid.dp * cfg.grad_accum_steps)
    return cfg.validate(on_this_machine)


MAX_TIMEOUT_S = 30 * 86400  # 30 days: a run's stop watch (threading's timers refuse much more)


def _check_flags(args) -> None:
    """The flags that are not RunConfig fields, in range, before anything is built or started."""
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise ConfigError(f"--timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:,} (30 days), "
                          f"got {timeout:g}")
    tolerance = getattr(args, "tolerance", None)
    if tolerance is not None and not 0 <= tolerance < 1:
        raise ConfigError(f"--tolerance must be a number from 0 to below 1 (the largest difference from one device's "
                          f"weights and losses that passes; the default is 1e-05), got {tolerance:g}")


def _grid(grid) -> str:
    """A grid (or its dict) as the summaries write it: dp 2 x pp 1 x tp 1."""
    return " x ".join(f"{k} {v}" for k, v in (grid if isinstance(grid, dict) else grid.as_dict()).items())


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def cmd_run(args) -> int:
    from multigpu.launch import launch

    cfg = _config(args)
    if cfg.info.module.startswith("deepspeed"):  # its first run on a CPU builds an extension, silently otherwise
        from multigpu.strategies.deepspeed import EXTENSIONS_DIR

        if not any(Path(os.environ.get("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)).rglob("*.so")):
            print("multigpu: DeepSpeed builds its C++ extension on its first run here (a minute or two, once; "
                  f"kept in {EXTENSIONS_DIR} for the next runs)", file=sys.stderr)
    record = launch(cfg, port=args.port, timeout_s=args.timeout, progress=None if not args.json else False,
                    nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                    check_memory=not args.no_memory_check, max_restarts=args.max_restarts)
    if args.json:
        print(json.dumps(record))
        return 0
    mem = record["peak_memory_bytes_by_rank"][0]
    workers = (f"{cfg.world_size} replica(s) in one process" if cfg.processes != cfg.world_size
               else f"{cfg.world_size} process(es)")
    print(f"{cfg.strategy} on {workers}, {record['provenance']['backend']}, "
          f"model {cfg.model} ({record['parameters']:,} parameters)")
    if record.get("strategy_report", {}).get("implementation"):
        print(f"  implementation  {record['strategy_report']['implementation']}")
    d = cfg.degrees
    if d["tp"] > 1 or d["pp"] > 1 or d.get("cp", 1) > 1 or d.get("ep", 1) > 1:
        cut = f" x cp {d['cp']}" if d.get("cp", 1) > 1 else ""
        experts = f" (experts cut over ep {d['ep']} of the dp ranks)" if d.get("ep", 1) > 1 else ""
        print(f"  grid        dp {d['dp']} x pp {d['pp']}{cut} x tp {d['tp']} = {cfg.world_size} processes{experts}")
    if cfg.activation_checkpointing:
        from multigpu.recompute import recompute_mode

        print(f"  recompute   {recompute_mode(cfg.activation_checkpointing)} activation checkpointing")
    print(f"  batch       {cfg.global_batch_size} samples per step = {d['dp']} x "
          f"{cfg.per_rank_batch_size} (micro-batches of {cfg.micro_batch_size})")
    print(f"  loss        {record['loss'][0]:.4f} -> {record['loss'][-1]:.4f} over {cfg.steps} steps")
    ckpt = record.get("checkpoint", {})
    if ckpt.get("resumed"):
        r = ckpt["resumed"]
        print(f"  resumed     from {r['path']} ({r['steps_done']} steps done, saved by {r['saved_by']['strategy']} "
              f"on {_grid(r['saved_by']['grid'])})")
    for save in (ckpt.get("saves") or [[]])[0]:
        print(f"  checkpoint  step {save['steps_done']}: {_mib(save['bytes_total'])} written, training blocked "
              f"{save['blocking_s'] * 1e3:.0f} ms of {save['total_s'] * 1e3:.0f} ms" + " (async)" * save["async"])
    if record["step_time_s"] is None:  # a reshard: no step trained
        return 0
    steps = f"{record['timed_steps']} step{'s' * (record['timed_steps'] != 1)}"
    print(f"  step time   {record['step_time_s'] * 1e3:.1f} ms (median of {steps})" + (
        "; in a run this short the timed steps also ran the memory tracker or traffic counter, whose overhead it "
        "includes: give more --steps for clean times" if record.get("step_time_includes_tracking") else ""))
    print(f"  throughput  {record['tokens_per_s']:,.0f} tokens/s, {record['samples_per_s']:,.1f} samples/s")
    from multigpu.estimator.flops import utilization

    use = utilization(record)
    print(f"  MFU         {use['mfu']:.1%} of this machine's measured peak (HFU {use['hfu']:.1%})" if use else
          "  MFU         no measured peak of this machine: `python -m multigpu figures --experiments machine_limits`")
    for rank, profile in enumerate(record.get("profile_by_rank") or []):
        seconds = {k: v for k, v in profile["seconds"].items() if k not in ("step", "largest")}
        shares = ", ".join(f"{k} {v / sum(seconds.values()):.0%}" for k, v in seconds.items())
        print(f"  profile, rank {rank}: {shares}" + (f"; trace {profile['trace']}" if profile.get("trace") else ""))
    who = "primary replica" if cfg.info.one_process else "rank 0"
    measured = ", ".join(f"{k} {_mib(v)}" for k, v in mem.items() if v is not None)
    print(f"  peak memory, {who}: " + (measured or "not measured (the memory tracker cannot follow this strategy)"))
    comm = record["comm_payload_bytes_per_step_by_rank"][0]
    if comm:
        print("  collectives per step, rank 0: " + ", ".join(f"{k} {_mib(v)}" for k, v in comm.items()))
    if record.get("moe"):
        from multigpu.moe import dropped_by_step

        dropped = dropped_by_step(record["moe"])
        factor = record["moe"].get("capacity_factor")
        print(f"  experts     top-{record['moe']['top_k']} routing, capacity factor "
              f"{'none (no limit)' if factor is None else f'{factor:g}'}: at most {max(dropped):.1%} of a step's "
              "routed tokens dropped (--json's moe: by layer and expert)")
    return 0


def cmd_check(args) -> int:
    from multigpu.check import check

    if args.matrix:  # every composition at degree 2 in 8 processes, dense and MoE
        from multigpu.matrix import cmd_matrix

        return cmd_matrix(args)
    cfg = _config(args)
    options = {k: v for k, v in cfg.to_dict().items()
               if k not in ("strategy", "world_size", "steps", "track_memory", "fault")}
    result = check(cfg.strategy, cfg.world_size, steps=args.steps, tolerance=args.tolerance, **options)
    if args.json:
        print(json.dumps(result))
    else:
        verdict = "PASSED" if result["passed"] else "FAILED"
        print(f"{verdict}: {result['strategy']} on {result['world_size']} processes vs single, "
              f"{result['steps']} steps: max |param diff| {result['max_abs_param_diff']:.2e}, "
              f"max |loss diff| {result['max_abs_loss_diff']:.2e} (tolerance {result['tolerance']:.0e})")
    return 0 if result["passed"] else 1


def cmd_export(args) -> int:
    """A checkpoint's weights as a Hugging Face model folder (config.json and model.safetensors), for a
    reader who goes on with transformers: the package's GPT as GPT2LMHeadModel, a model transformers built
    (a config.json's, a T5) as itself."""
    from multigpu import checkpoint, hf
    from multigpu.models import build_model

    weights, meta = checkpoint.whole_weights(args.checkpoint)
    model = build_model(meta["config"]["model"])
    if not hasattr(model, "save_pretrained"):  # the package's GPT: into transformers' GPT-2
        from transformers import GPT2Config, GPT2LMHeadModel

        config = hf.gpt2_config(model.cfg)
        model, weights = GPT2LMHeadModel(GPT2Config(**config)), hf.gpt2_state_dict(weights)
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(args.out)
    print(f"{meta['config']['model']} after {meta['steps_done']} steps -> {args.out} "
          f"({type(model).__name__}: transformers' from_pretrained reads it)")
    return 0


def cmd_dryrun(args) -> int:
    """One step of a plan at its full size, on fake tensors and a fake process group (multigpu.dryrun), each
    distinct rank's measurements beside the estimator's (multigpu.estimator.held)."""
    from multigpu import dryrun
    from multigpu.estimator.held import report, rows

    if args.world_size is None:
        raise ConfigError("dryrun needs --world-size: the ranks of the world planned (up to any size, e.g. 1024)")
    dryrun.refuse_world(args.strategy, args.world_size)  # before any config is built
    cfg = _config(args, on_this_machine=False)
    dryrun.refuse(cfg)  # a plan that cannot run this way, with the reason
    if args.rank is not None and not 0 <= args.rank < cfg.processes:
        raise ConfigError(f"--rank {args.rank} is not in a world of {cfg.processes} (ranks 0 to {cfg.processes - 1})")
    materialize = dryrun.materialize_device(cfg, args.materialize)
    runs = dryrun.dry_runs(cfg, materialize) if args.rank is None else [
        dryrun.dry_run(cfg, args.rank, f"rank {args.rank}", materialize)]
    if args.json:
        print(json.dumps([{**run.as_dict(), "estimator": rows(cfg, run)} for run in runs]))
        return 0
    print(f"{cfg.model}, {cfg.strategy} on {cfg.world_size} ranks ({_grid(cfg.grid)}), {cfg.global_batch_size} "
          f"sample(s) of {runs[0].seq_len} tokens per step in {cfg.grad_accum_steps} micro-batch(es): a dry run")
    print("\n".join(report(cfg, runs)))
    print("".join(f"{dryrun.materialized_line(run)}\n" for run in runs if run.materialized), end="")
    if not any(rows(cfg, run) for run in runs):
        from multigpu.estimator.held import not_estimated

        print(f"(measurements only: {not_estimated(cfg)})")
    return 0


def cmd_figures(args) -> int:
    from multigpu.experiments import EXPERIMENTS, ExperimentFailed, run_experiments

    if args.list:  # each experiment and the module (the chapter's) that makes its runs
        for name, make in EXPERIMENTS.items():
            print(f"{name:<24} {make.__module__.removeprefix('multigpu.experiments.')}")
        return 0
    try:
        run_experiments(args.experiments)
    except ExperimentFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (its usage block runs to twenty)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (what `main` parses; recipes' commands are checked with it)."""
    parser = _Parser(prog="python -m multigpu", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with a strategy and print the record")
    _add_run_options(run)
    run.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    run.add_argument("--timeout", type=float, default=900, help="seconds before the run is stopped")
    run.add_argument("--nnodes", type=int, default=1, help="machines in the run; each runs this same command "
                     "with its own --node-rank and starts world-size / nnodes processes")
    run.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 to nnodes - 1; node 0 "
                     "hosts the rendezvous")
    run.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT where the nodes meet: node 0's address and "
                     "a free port every node can reach (needed with --nnodes > 1)")
    run.add_argument("--dataset-size", type=int, default=None,
                     help="samples in the data set (default: global batch x steps; fix it to train a saved run longer)")
    run.add_argument("--checkpoint-dir", default=None, help="save the run's state into DIR/step-N (weights, optimizer, "
                     "data position, generators), after the last step and every --checkpoint-every steps")
    run.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints")
    run.add_argument("--checkpoint-keep", type=int, default=RunConfig().checkpoint_keep,
                     help="the newest complete checkpoints kept (older ones are deleted)")
    run.add_argument("--checkpoint-async", action="store_true",
                     help="write checkpoints in the background while training goes on (DCP's async_save)")
    run.add_argument("--resume", default=None, help="continue from a checkpoint: a step-N folder, or a "
                     "--checkpoint-dir (its newest); as many --steps as it has done saves it again under this "
                     "run's layout (a reshard) without training")
    run.add_argument("--max-restarts", type=int, default=0, help="times torchrun restarts the workers after a "
                     "failure; with --checkpoint-dir they continue from the newest checkpoint")
    run.add_argument("--no-memory-check", action="store_true",
                     help="start even if the estimator says the run does not fit in this machine's free memory")
    run.set_defaults(func=cmd_run)
    exp = sub.add_parser("export", help="a checkpoint's weights as a Hugging Face model folder")
    exp.add_argument("checkpoint", help="a step-N folder, or a --checkpoint-dir (its newest)")
    exp.add_argument("out", help="the folder to write (config.json, model.safetensors)")
    exp.set_defaults(func=cmd_export)
    chk = sub.add_parser("check", help="parity of a strategy with single-device training")
    _add_run_options(chk)
    chk.set_defaults(steps=3, optimizer="sgd-momentum", lr=0.05)
    chk.add_argument("--tolerance", type=float, default=1e-5)
    chk.add_argument("--matrix", action="store_true", help="every composition of dp, tp, pp and cp at degree 2 in "
                     "8 processes, dense and a mixture of experts, each against one device (minutes)")
    chk.set_defaults(func=cmd_check)
    dry = sub.add_parser("dryrun", help="one step of a plan at any world size on fake tensors: what each rank holds "
                         "and sends, beside the estimator's numbers")
    _add_run_options(dry)
    dry.set_defaults(global_batch_size=None, optimizer="adamw", func=cmd_dryrun)
    dry.add_argument("--rank", type=int, default=None, help="this rank only (default: each distinct role: a "
                     "pipeline's first, middle and last stage)")
    dry.add_argument("--materialize", nargs="?", const="auto", default=None, choices=("auto", "cpu", "cuda"),
                     help="real tensors on this device (cuda if there is one), the group still fake: the rank's own "
                     "kernels run, and on a GPU the allocator's peak is recorded")
    add_estimator_commands(sub)  # estimate, advise: multigpu.estimator.cli
    fig = sub.add_parser("figures", help="run the experiments behind the book's figures")
    fig.add_argument("--experiments", nargs="*", default=None, help="names (default: all; --list names them)")
    fig.add_argument("--list", action="store_true", help="list the experiments and exit")
    fig.set_defaults(func=cmd_figures)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from multigpu.launch import LaunchError

    try:
        _check_flags(args)
        return args.func(args)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; every worker was stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
