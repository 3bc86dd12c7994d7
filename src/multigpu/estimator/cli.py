"""The estimator's commands: `python -m multigpu estimate ...` (memory per rank, the largest
batch) and `python -m multigpu advise ...` (a strategy, with the estimator's numbers as reasons).
Nothing here starts a process; `__main__` adds these commands to its parser."""

from __future__ import annotations

import json

from multigpu.config import ATTENTION, OPTIMIZERS, ConfigError
from multigpu.estimator.machines import MACHINES
from multigpu.strategy_table import ESTIMATED


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


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
    _check_question(setup, args.batch_size)  # before the model is traced (seconds for a large one)
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
              f"{_gib(setup.cuda_workspace_bytes)} for cuBLAS's two workspaces on each {args.gpu}")
    if machine is not None:
        print(f"  the machine's own peak, calibrated: {_gib(machine)} ({calibration.describe()})")
    elif calibration is not None and not result.global_batch:
        print(f"  model states only: a {device} machine's own peak is calibrated here for a training step; give "
              "--batch-size or --max-batch for it")
    elif not args.uncalibrated and total:
        print(f"  no {device} machine's own peak is recorded here ({CALIBRATED_BY} records), so what must fit is "
              f"the tensors alone; `python -m multigpu figures --experiments {CALIBRATED_BY}` on such a machine "
              "calibrates it")
    if memory is not None:
        print(f"  fits: {'yes' if out['fits'] else 'no'} ({must_fit / memory:.0%} of {_gib(memory)})")
    print(f"  method: {result.method}")
    print(f"  answered in {out['seconds']:.1f} s")
    return 0


def _check_question(setup, batch_size: int | None) -> None:
    """The numbers of an estimate's question in range, and the batch split over the ranks, before any tracing."""
    from multigpu.estimator.advise import MAX_GLOBAL_BATCH, MAX_GPUS
    from multigpu.estimator.peak import _per_rank_batch
    from multigpu.estimator.question import check_setup

    if not 1 <= setup.world_size <= MAX_GPUS:
        raise ConfigError(f"--world-size must be a whole number from 1 to {MAX_GPUS:,}, got {setup.world_size:,}")
    check_setup(setup)  # the strategy, the degrees, the lengths, the accumulation steps
    if setup.grad_accum_steps > MAX_GLOBAL_BATCH:
        raise ConfigError(f"--grad-accum-steps must be at most {MAX_GLOBAL_BATCH:,}, got {setup.grad_accum_steps:,}")
    if batch_size is not None:
        if batch_size > MAX_GLOBAL_BATCH:
            raise ConfigError(f"--batch-size must be at most {MAX_GLOBAL_BATCH:,} samples, got {batch_size:,}")
        _per_rank_batch(setup, batch_size)


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
                 cuda_context_bytes=context, on_cuda=True)  # its machines are GPUs: their kernels, allocator
    advice = advise(base, args.gpus, memory, nodes=args.nodes, interconnect=args.interconnect,
                    machine=args.machine, global_batch=args.global_batch, overlap=not args.no_overlap,
                    gpu=args.gpu)
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
    if args.dry_run:
        _dry_run_plans(advice)
    return 0


def _dry_run_plans(advice) -> None:
    """The recommended plan and the runner-up, dry-run at their full size (multigpu.dryrun), their measurements
    beside the estimates the advice rests on; a plan of many micro-batches as one (a pipeline's schedule whole)."""
    from dataclasses import replace

    from multigpu.estimator.held import config_of, report
    from multigpu.estimator.question import PIPELINES

    for title, plan in (("recommended", advice.plan), ("runner-up", advice.plans[1] if len(advice.plans) > 1
                                                       else None)):
        if plan is None:
            continue
        print(f"\n{title}, dry-run: {plan.label} on {plan.setup.world_size} ranks", flush=True)  # (it takes a while)
        setup, batch, m = plan.setup, plan.global_batch, plan.setup.grad_accum_steps
        if m > 1 and setup.strategy not in PIPELINES:  # each micro-batch holds and sends what the first does
            setup, batch = replace(setup, grad_accum_steps=1), batch // m
            print(f"  (one of its {m} micro-batches of {plan.memory.per_rank_batch} sample(s) per rank, as a step of "
                  f"{batch} samples: each micro-batch holds the same, and a dry run executes every one)", flush=True)
        try:
            cfg = config_of(setup, batch)
        except ConfigError as e:
            print(f"  not dry-run: {e}")
            continue
        from multigpu.dryrun import dry_runs

        print("\n".join("  " + line for line in report(cfg, dry_runs(cfg))))


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


def add_estimator_commands(sub) -> None:
    """The `estimate` and `advise` subcommands, on `sub` (argparse's subparsers)."""
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
    est.add_argument("--attention", choices=ATTENTION, default="sdpa",
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
    est.add_argument("--activation-checkpointing", nargs="?", const=True, default=False, metavar="full|selective",
                     choices=(True, "full", "selective"), help="recompute blocks' activations in backward: all (full, "
                     "the default) or all but the products' and attention's outputs (selective)")
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
    adv.add_argument("--activation-checkpointing", nargs="?", const=True, default=False, metavar="full|selective",
                     choices=(True, "full", "selective"), help="recompute blocks' activations in backward: all (full, "
                     "the default) or all but the products' and attention's outputs (selective)")
    adv.add_argument("--json", action="store_true")
    adv.add_argument("--dry-run", action="store_true", help="also run the recommended plan and the runner-up at "
                     "their full size on fake tensors (python -m multigpu dryrun) and print what they hold and send "
                     "beside the estimates")
    adv.set_defaults(func=cmd_advise)

    from multigpu.estimator.predict import add_predict_command

    add_predict_command(sub)
