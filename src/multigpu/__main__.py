"""Command line: python -m multigpu {run, check, figures} ...

    python -m multigpu run --strategy ddp --world-size 2 --model gpt-tiny --steps 20 [--json]
    python -m multigpu check --strategy ddp-scratch --world-size 4 [--json]
    python -m multigpu figures [--experiments NAME ...]
    python -m multigpu estimate --model t5-large --strategy fsdp --world-size 4 --gpu-memory 32GiB --max-batch
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from multigpu.config import OPTIMIZERS, STRATEGIES, ConfigError, RunConfig, with_strategy_defaults
from multigpu.estimator.machines import MACHINES
from multigpu.strategy_table import ESTIMATED


def _add_run_options(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--strategy", default=d.strategy, help=f"one of: {', '.join(STRATEGIES)}")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: 1 for single, 2 otherwise)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree, with a data-parallel strategy")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree, with a data-parallel strategy")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree (default: what --world-size leaves after --tp and --pp)")
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
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--dataset", default=d.dataset, help="synthetic (learnable) or dummy (random ids)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")


def _config(args) -> RunConfig:
    world_size = args.world_size if args.world_size is not None else (1 if args.strategy == "single" else 2)
    extra = {"sequence_parallel": True} if args.sequence_parallel else {}
    if args.hsdp_replicas is not None:
        if args.strategy != "fsdp":
            raise ConfigError(f"--hsdp-replicas is hybrid sharding, an fsdp option; got --strategy {args.strategy}")
        extra["replicas"] = args.hsdp_replicas
    d = RunConfig()
    cfg = RunConfig(strategy=args.strategy, world_size=world_size, tp=args.tp, pp=args.pp, dp=args.dp,
                    model=args.model or d.model, extra=extra)
    global_batch_size = args.global_batch_size
    if args.per_rank_batch_size is not None:
        if args.per_rank_batch_size < 1:
            raise ConfigError(f"--per-rank-batch-size must be >= 1, got {args.per_rank_batch_size}")
        if cfg.strategy in STRATEGIES:
            global_batch_size = args.per_rank_batch_size * cfg.grid.dp  # the grid, checked
    cfg = cfg.replace(
        global_batch_size=global_batch_size, grad_accum_steps=args.grad_accum_steps or d.grad_accum_steps,
        seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr, steps=args.steps,
        activation_checkpointing=args.activation_checkpointing, dataset=args.dataset, seed=args.seed,
        device=args.device, bucket_cap_mb=args.bucket_cap_mb, threads_per_worker=args.threads_per_worker,
    )
    if cfg.strategy in STRATEGIES:  # what the strategy needs and the defaults do not give, said
        chosen = {name for name in ("model", "grad_accum_steps") if getattr(args, name) is not None}
        cfg, notes = with_strategy_defaults(cfg, chosen)
        for note in notes:
            print(f"multigpu: {note}", file=sys.stderr)
    return cfg.validate()


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def cmd_run(args) -> int:
    from multigpu.launch import launch

    cfg = _config(args)
    record = launch(cfg, port=args.port, timeout_s=args.timeout, progress=None if not args.json else False,
                    nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                    check_memory=not args.no_memory_check)
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
    if d["tp"] > 1 or d["pp"] > 1:
        print(f"  grid        dp {d['dp']} x pp {d['pp']} x tp {d['tp']} = {cfg.world_size} processes")
    print(f"  batch       {cfg.global_batch_size} samples per step = {d['dp']} x "
          f"{cfg.per_rank_batch_size} (micro-batches of {cfg.micro_batch_size})")
    print(f"  loss        {record['loss'][0]:.4f} -> {record['loss'][-1]:.4f} over {cfg.steps} steps")
    print(f"  step time   {record['step_time_s'] * 1e3:.1f} ms (median of {record['timed_steps']} steps)")
    print(f"  throughput  {record['tokens_per_s']:,.0f} tokens/s, {record['samples_per_s']:,.1f} samples/s")
    who = "primary replica" if cfg.info.one_process else "rank 0"
    measured = ", ".join(f"{k} {_mib(v)}" for k, v in mem.items() if v is not None)
    print(f"  peak memory, {who}: " + (measured or "not measured (the memory tracker cannot follow this strategy)"))
    comm = record["comm_payload_bytes_per_step_by_rank"][0]
    if comm:
        print("  collectives per step, rank 0: " + ", ".join(f"{k} {_mib(v)}" for k, v in comm.items()))
    return 0


def cmd_check(args) -> int:
    from multigpu.check import check

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


def cmd_estimate(args) -> int:
    import time

    from multigpu.estimator.accuracy import CALIBRATED_BY, machine_calibration
    from multigpu.estimator.model_trace import model_shape
    from multigpu.estimator.peak import estimate, predict_largest_batch
    from multigpu.estimator.question import Setup, cublas_workspace_bytes

    start = time.perf_counter()
    memory, context = _device_memory(args)
    if args.max_batch and memory is None:
        raise ConfigError("--max-batch needs the memory of one device: --gpu-memory 32GiB or --gpu a100-80gb")
    if args.max_batch and args.batch_size is not None:
        raise ConfigError("give either --batch-size or --max-batch, not both")
    setup = Setup(model=args.model, strategy=args.strategy, world_size=args.world_size, seq_len=args.seq_len,
                  target_len=args.target_len, dtype=args.dtype, optimizer=args.optimizer,
                  activation_checkpointing=args.activation_checkpointing, grad_accum_steps=args.grad_accum_steps,
                  reshard_after_forward=args.reshard_after_forward == "true",
                  offload_optimizer=args.offload_optimizer, cuda_context_bytes=context,
                  cuda_workspace_bytes=cublas_workspace_bytes(args.gpu), on_cuda=_on_cuda(args),
                  dropout=not args.no_dropout, attention=args.attention,
                  tp=args.tp, pp=args.pp, sequence_parallel=args.sequence_parallel)
    device = "cuda" if setup.on_cuda else "cpu"
    calibration = None if args.uncalibrated else machine_calibration(device, model_shape(setup.model).family)
    if args.max_batch:
        found = predict_largest_batch(setup, memory, calibration)
        result = found or estimate(setup, setup.world_size * setup.grad_accum_steps)
        max_batch = found.global_batch if found else 0
    else:
        result, max_batch = estimate(setup, args.batch_size), None
    total = result.per_rank_bytes["total"]
    machine = calibration.machine_bytes(result) if calibration and result.global_batch else None
    must_fit = machine if machine is not None else total
    out = {**result.as_dict(), "fits": None if memory is None else must_fit <= memory, "memory_bytes": memory,
           "machine_bytes": machine, "calibration": calibration.describe() if calibration else None,
           "seconds": round(time.perf_counter() - start, 3)}
    if args.max_batch:
        out["max_batch_size"] = max_batch
    if args.json:
        print(json.dumps(out))
        return 0
    target = f", target {setup.target_len}" if setup.target_len else ""
    print(f"{setup.model} with {setup.strategy} on {setup.world_size} rank(s), {setup.dtype}, {setup.optimizer}, "
          f"sequence {setup.seq_len}{target}" + (f", {_gib(memory)} per device" if memory else ""))
    d = result.as_dict()["degrees"]
    print(f"  grid: dp {d['dp']} x pp {d['pp']} x tp {d['tp']}"
          + (f"; the peak is pipeline rank {result.pipeline_rank}'s" if result.pipeline_rank is not None else ""))
    if args.max_batch:
        print(f"  largest global batch that fits: {max_batch}"
              + (f" ({result.per_rank_batch} per rank per micro-batch)" if max_batch else " (not even one sample)"))
    elif result.global_batch is not None:
        print(f"  global batch {result.global_batch} ({result.per_rank_batch} per rank per micro-batch)")
    print(f"  per rank, at the peak ({result.phase}):")
    for k, v in result.per_rank_bytes.items():
        print(f"    {k:<12}{_gib(v):>12}")
    if context or setup.cuda_workspace_bytes:
        print(f"  'other' includes {_gib(context)} assumed for the CUDA context (--cuda-context to change) and "
              f"{_gib(setup.cuda_workspace_bytes)} for cuBLAS's two workspaces on a {args.gpu}")
    if machine is not None:
        print(f"  the machine's own peak, calibrated: {_gib(machine)} ({calibration.describe()})")
    elif not args.uncalibrated and total:
        print(f"  no {device} machine's own peak is recorded here ({CALIBRATED_BY} records), so what must fit is "
              f"the tensors alone; `python -m multigpu figures --experiments {CALIBRATED_BY}` on such a machine "
              "calibrates it")
    if memory is not None:
        print(f"  fits: {'yes' if out['fits'] else 'no'} ({must_fit / memory:.0%} of {_gib(memory)})")
    print(f"  method: {result.method}")
    print(f"  answered in {out['seconds']:.1f} s")
    return 0


def _on_cuda(args) -> bool:
    """Whether the estimate is for a GPU's kernels and allocator: --device, else a named --gpu."""
    if args.device == "cpu" and args.gpu is not None:
        raise ConfigError(f"--gpu {args.gpu} names a GPU but --device cpu asks about a CPU; drop one of them")
    return args.device == "cuda" or (args.device is None and args.gpu is not None)


def cmd_advise(args) -> int:
    from multigpu.estimator.advise import advise
    from multigpu.estimator.machines import describe
    from multigpu.estimator.question import DEFAULT_CUDA_CONTEXT, Setup

    memory, context = _device_memory(args, smallest=SMALLEST_GPU)
    if args.machine is None and memory is None:
        raise ConfigError("give the memory of one GPU (--gpu-memory 32GiB or --gpu a100-80gb), or a --machine")
    if args.machine and args.cuda_context is None:
        context = DEFAULT_CUDA_CONTEXT
    base = Setup(model=args.model, seq_len=args.seq_len, target_len=args.target_len, dtype=args.dtype,
                 optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
                 cuda_context_bytes=context)
    advice = advise(base, args.gpus, memory, nodes=args.nodes, interconnect=args.interconnect,
                    machine=args.machine, global_batch=args.global_batch, overlap=not args.no_overlap)
    if args.json:
        print(json.dumps(advice.as_dict()))
        return 0
    print(f"recommended: {advice.plan.label if advice.plan else advice.strategy}")
    if advice.plan:
        print(f"  run it: {advice.plan.command}")
    for reason in advice.reasons:
        print(f"  - {reason}")
    print("  the fastest plan of each family (estimates):")
    for row in advice.by_family():
        print(f"    {row['family']:<9} {row['plan']:<40} {row['GiB per GPU']:6.1f} GiB  "
              + (f"{row['s per step']:.3g} s per step" if row["fits"] else "does not fit"))
    print("  machine: " + "; ".join(describe(advice.machine)))
    return 0


CUDA_CONTEXT_HELP = ("memory the CUDA context takes on each GPU, counted in 'other'; default 500MiB with "
                     "--gpu, 0 with --gpu-memory")


def _device_memory(args, smallest: int = 2**20) -> tuple[int | None, int]:
    """(memory of one device, CUDA context assumed in it) from --gpu-memory or --gpu, and
    --cuda-context: by default 500 MiB for a named GPU, nothing for a bare amount. A device
    of at most `smallest` bytes, or no more than its context, is an input error."""
    from multigpu.config import parse_bytes
    from multigpu.estimator.question import DEFAULT_CUDA_CONTEXT, GPUS

    if args.gpu is not None and args.gpu not in GPUS:
        raise ConfigError(f"unknown --gpu {args.gpu!r}; choose one of: {', '.join(GPUS)} (or give --gpu-memory)")
    memory = parse_bytes(args.gpu_memory) if args.gpu_memory else GPUS.get(args.gpu)
    if args.cuda_context is not None:
        context = parse_bytes(args.cuda_context, allow_zero=True)
    else:
        context = DEFAULT_CUDA_CONTEXT if args.gpu is not None else 0
    if memory is not None and memory <= max(context, smallest):
        size = f"{memory:,} bytes" if memory < 2**20 else _mib(memory)
        raise ConfigError(f"a device of {size} cannot train anything: it must hold more than "
                          + (f"its CUDA context ({_mib(context)}, --cuda-context)" if context >= smallest else
                             f"{_mib(smallest)}") + "; give the memory of one device, e.g. --gpu-memory 32GiB "
                          "or --gpu a100-80gb")
    return memory, context


# a CUDA context alone takes a few hundred MiB of every GPU (PyTorch's notes on CUDA
# semantics): advice for GPUs smaller than this has nothing to advise
SMALLEST_GPU = 256 * 2**20


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def cmd_figures(args) -> int:
    from multigpu.experiments import ExperimentFailed, run_experiments

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
    run.add_argument("--no-memory-check", action="store_true",
                     help="start even if the estimator says the run does not fit in this machine's free memory")
    run.set_defaults(func=cmd_run)
    chk = sub.add_parser("check", help="parity of a strategy with single-device training")
    _add_run_options(chk)
    chk.set_defaults(steps=3, optimizer="sgd-momentum", lr=0.05)
    chk.add_argument("--tolerance", type=float, default=1e-5)
    chk.set_defaults(func=cmd_check)
    est = sub.add_parser("estimate", help="memory per rank, and the largest batch, before running anything")
    est.add_argument("--model", required=True, help="a preset (t5-large, gpt2, ...), a Hugging Face config.json "
                     "(t5 or gpt2), or params:<count> for model states only")
    est.add_argument("--strategy", default="ddp", help=", ".join(ESTIMATED))
    est.add_argument("--world-size", type=int, default=1, help="GPUs (ranks)")
    est.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: with --strategy fsdp (2D), tp "
                     "(default: all ranks) or a pipeline; the package's GPT only")
    est.add_argument("--pp", type=int, default=1, help="pipeline ranks, with --strategy pp-gpipe, pp-1f1b or "
                     "pp-interleaved (default: world size / tp; the rest is FSDP inside each stage); "
                     "--grad-accum-steps is its micro-batches")
    est.add_argument("--sequence-parallel", action="store_true",
                     help="with tp: cut the residual stream and LayerNorms along the sequence")
    est.add_argument("--dtype", default="fp32", help="fp32; bf16-mixed or fp16-mixed (autocast, fp32 weights, as "
                     "this package trains); bf16-master (bf16 weights and an fp32 master copy, as the ZeRO paper "
                     "and DeepSpeed)")
    est.add_argument("--optimizer", default="adamw", help=", ".join(OPTIMIZERS))
    est.add_argument("--seq-len", type=int, default=256, help="tokens per sample (the encoder's, for T5)")
    est.add_argument("--target-len", type=int, default=None, help="the decoder's tokens (T5; default: --seq-len)")
    est.add_argument("--gpu-memory", default=None, help="memory of one device, e.g. 32GiB or 80GB")
    est.add_argument("--gpu", default=None, help="a named GPU for its memory, e.g. v100-32gb, a100-80gb, h100-80gb")
    est.add_argument("--cuda-context", default=None, help=CUDA_CONTEXT_HELP)
    est.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="whose kernels and allocator: cuda (a dropout keeps a 1-byte mask, fused attention no "
                     "S x S probabilities, Adam's step a temporary, 512-byte blocks) or cpu (this package's "
                     "trace as a CPU runs it); default: cuda with --gpu, else cpu")
    est.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                     help="how attention is computed: sdpa (one fused call) or eager (T5 only: the operations "
                     "one by one, as transformers ran T5 before SDPA)")
    est.add_argument("--uncalibrated", action="store_true",
                     help="fit the tensors alone, not the machine's peak calibrated on recorded runs "
                     "(multigpu.estimator.accuracy.machine_calibration)")
    est.add_argument("--no-dropout", action="store_true",
                     help="the model without dropout (T5 presets have the released 0.1)")
    est.add_argument("--batch-size", type=int, default=None, help="global batch: all ranks together")
    est.add_argument("--max-batch", action="store_true", help="find the largest global batch that fits")
    est.add_argument("--grad-accum-steps", type=int, default=1)
    est.add_argument("--activation-checkpointing", action="store_true")
    est.add_argument("--reshard-after-forward", choices=("true", "false"), default="true", help="fsdp only")
    est.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer state in host memory")
    est.add_argument("--json", action="store_true", help="print one JSON object")
    est.set_defaults(func=cmd_estimate)

    adv = sub.add_parser("advise", help="recommend a strategy, with the estimator's numbers as reasons")
    adv.add_argument("--model", required=True, help="a preset or a Hugging Face config.json (t5 or gpt2)")
    adv.add_argument("--gpus", type=int, default=None, help="GPUs in all (or --machine)")
    adv.add_argument("--machine", default=None, choices=list(MACHINES), help="a named machine: its GPUs, memory, "
                     "FLOP/s and links, each with its source (instead of --gpus/--gpu-memory/--nodes/--interconnect)")
    adv.add_argument("--global-batch", type=int, default=None,
                     help="samples per step (default: about half a million tokens, a multiple of the GPUs)")
    adv.add_argument("--no-overlap", action="store_true",
                     help="time the steps as if no collective hid behind compute (the other bound)")
    adv.add_argument("--gpu-memory", default=None, help="memory of one GPU, e.g. 32GiB")
    adv.add_argument("--gpu", default=None, help="a named GPU for its memory, e.g. a100-80gb")
    adv.add_argument("--cuda-context", default=None, help=CUDA_CONTEXT_HELP)
    adv.add_argument("--nodes", type=int, default=1)
    adv.add_argument("--interconnect", default="fast", help="between nodes, without --machine: fast (8 x 400 Gb/s "
                     "InfiniBand per node) or slow (one 100 Gb/s Ethernet port); H100-class GPUs and NVLink assumed")
    adv.add_argument("--dtype", default="fp32", help="fp32, bf16-mixed, fp16-mixed or bf16-master")
    adv.add_argument("--optimizer", default="adamw", help=", ".join(OPTIMIZERS))
    adv.add_argument("--seq-len", type=int, default=256)
    adv.add_argument("--target-len", type=int, default=None)
    adv.add_argument("--activation-checkpointing", action="store_true")
    adv.add_argument("--json", action="store_true")
    adv.set_defaults(func=cmd_advise)

    fig = sub.add_parser("figures", help="run the experiments behind the book's figures")
    fig.add_argument("--experiments", nargs="*", default=None, help="names (default: all)")
    fig.set_defaults(func=cmd_figures)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    from multigpu.launch import LaunchError

    try:
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
