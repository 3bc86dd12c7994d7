"""Pipeline parallelism with PyTorch's library: `torch.distributed.pipelining`.

The model's blocks are cut into stages, one process per stage (or two, see below), and the
batch into m micro-batches that flow through the stages one after another: while stage 1
works on micro-batch 0, stage 0 already works on micro-batch 1. What is left idle while the
pipeline fills and drains is the "bubble": (p-1)/(m+p-1) of the step for p stages (GPipe,
Huang et al. 2018, https://arxiv.org/abs/1811.06965), so m must be large against p.

The library has three parts, and we use two:
- `PipelineStage(module, stage_index, num_stages, device, group=...)`: one stage's module
  and the point-to-point sends and receives around it. Its input and output shapes are
  learned from the first micro-batch ("dynamic mode"), so every micro-batch must have the
  same shape.
- a schedule, which decides the order of forwards (F) and backwards (B) on every rank and
  runs the loss on the last stage: `schedule.step(input_ids, target=labels, losses=[])`.
  * `ScheduleGPipe`: all forwards, then all backwards; m activations alive per stage.
  * `Schedule1F1B` (PipeDream-Flush, Narayanan et al. 2021, https://arxiv.org/abs/2104.04473):
    after a warm-up, one forward then one backward, so at most p activations are alive.
  * `ScheduleInterleaved1F1B` (same paper): each rank holds v = 2 stages, r and r+p ("loop"
    placement); the bubble shrinks to (p-1)/(v*m+p-1), for twice the messages.
  * `ScheduleZBVZeroBubble` (Qi et al. 2023, https://arxiv.org/abs/2401.10241): the backward
    split into B (gradient of the input, which the previous stage waits for) and W (gradient
    of the weights, which nobody waits for), W filling the bubble. Two stages per rank in a
    "V": rank r holds stages r and 2p-1-r, so rank 0 holds the first and the last stage.
  * `ScheduleDualPipeV` (DeepSeek-V3, https://arxiv.org/abs/2412.19437): V placement too,
    forwards and backwards of two micro-batches overlapped; needs m >= 2p.
- the automatic split, `pipeline(model, mb_args, split_spec={"blocks.2": SplitPoint.BEGINNING})`,
  which traces the model with torch.export and cuts the graph (`traced_split` below shows
  it on a small model). It does not work for Hugging Face models with rotary embeddings:
  they trace, then fail at run time in the first stage (pytorch/pytorch#184361). We cut by
  hand instead, as torchtitan does: every rank builds the whole GPT from the same seed and
  deletes what its stages do not own (`pp_split.split_gpt`), so the initial weights and
  every parameter's name are the single device's.

Two pitfalls the schedules leave to us:
- gradient scale: with `scale_grads=True` (the default) the schedule divides every
  gradient by m after the last backward. We instead divide each micro-batch's loss by m,
  as the plain training loop does, and pass `scale_grads=False`: the gradients are then
  bit for bit those of one device running the same micro-batches in order.
- a tied head: GPT-2's head reuses the token embedding, which lives on the first stage
  while the head lives on the last. Each keeps a copy and the two gradients are summed
  after the backward (Megatron's "embedding group"); under V placement both copies are on
  rank 0, and the sum needs no communication.

With `--tp` and `--dp` the pipeline is one dimension of a grid (PP x TP, PP x FSDP, and
3D): each stage's piece is then made tensor parallel over its tp ranks and sharded with
FSDP2 over its dp ranks, in the order of `compose.py`, and the library's stage drives
FSDP (no reduce-scatter until a stage's last backward of the step).

Options: none. The strategy name picks the schedule (`SCHEDULES`); m is grad_accum_steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from multigpu.models import GPT, loss_from_logits
from multigpu.strategies import Parallelized, build_optimizer, compose
from multigpu.strategies.pp_scratch import ActionClock
from multigpu.strategies.pp_split import (
    deep_enough,
    deeper_preset,
    local_grad,
    loss_to_all,
    split_gpt,
    sync_tied_embedding,
    tied_embedding_group,
)
from multigpu.strategies.state import pipeline_state_dict


@dataclass(frozen=True)
class Schedule:
    """One row of the schedule table."""

    cls: type  # the library's schedule class
    stages_per_rank: int  # v: model chunks each rank holds
    placement: str  # "loop": rank r holds r, r+p, ...; "v": rank r holds r and 2p-1-r
    needs_m_ge_stages: bool  # the schedule refuses (or hangs with) fewer micro-batches than stages


SCHEDULES: dict[str, Schedule] = {
    "pp-gpipe": Schedule(ScheduleGPipe, 1, "loop", False),
    "pp-1f1b": Schedule(Schedule1F1B, 1, "loop", True),
    "pp-interleaved": Schedule(ScheduleInterleaved1F1B, 2, "loop", True),
    "pp-zbv": Schedule(ScheduleZBVZeroBubble, 2, "v", True),
    "pp-dualpipev": Schedule(ScheduleDualPipeV, 2, "v", True),
}


def stage_indices(schedule: Schedule, rank: int, p: int) -> list[int]:
    """The stages rank `rank` of a p-rank pipeline holds, in increasing order."""
    if schedule.placement == "v":  # down the V and back up: rank 0 holds the first and the last
        return sorted({rank + k * p if k % 2 == 0 else (k + 1) * p - 1 - rank
                       for k in range(schedule.stages_per_rank)})
    return [rank + k * p for k in range(schedule.stages_per_rank)]


def stage_rank(schedule: Schedule, stage: int, p: int) -> int:
    """The rank holding stage `stage` (the inverse of `stage_indices`)."""
    return next(r for r in range(p) if stage in stage_indices(schedule, r, p))


class StageModule(nn.Module):
    """One stage: a piece of the GPT (`split_gpt`) called with one positional input, as a
    PipelineStage calls its module: token ids on the first stage, hidden states on the
    others. The piece is the `piece` submodule; its own names are the single device's.
    The forward runs under autocast when asked (the backward, run by the schedule, outside
    it, as in the plain training loop)."""

    def __init__(self, piece: GPT, index: int, num_stages: int, device_type: str):
        super().__init__()
        self.piece = piece
        self.index, self.num_stages = index, num_stages
        self.device_type = device_type
        self.autocast_dtype: torch.dtype | None = None
        self.position_ids: torch.Tensor | None = None  # context parallelism: the first stage's tokens' places

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            if self.index == 0:
                return self.piece(input_ids=x, position_ids=self.position_ids)
            return self.piece(hidden=x)


def build_stages(model: GPT, schedule: Schedule, rank: int, p: int, device: torch.device,
                 cfg=None, grid=None) -> list[StageModule]:
    """This rank's stages, cut from the whole model (step 1 of the order in `compose.py`),
    then, given `cfg` and `grid`, steps 2-4 on each stage: tensor parallel, activation
    checkpointing, FSDP with the stage as its root (the library's stage drives FSDP only when
    the module it calls is the FSDP module).

    `model` itself becomes the first of them, cut in place (as the from-scratch pipeline cuts
    it), and only a rank's further stages are cut from copies: no whole model stays behind on
    the device. Each copy is made from the uncut model and cut at once, so at most one extra
    whole model exists at a time, and only while the stages are built."""
    num_stages = p * schedule.stages_per_rank
    first, *others = stage_indices(schedule, rank, p)
    pieces = {i: split_gpt(copy.deepcopy(model), i, num_stages) for i in others}
    pieces[first] = split_gpt(model, first, num_stages)
    stages = [StageModule(pieces[i], i, num_stages, device.type).to(device) for i in (first, *others)]
    if cfg is not None:
        for stage in stages:  # the schedule computes the loss from whole logits: no loss_parallel; with cp each
            # stage's attention is swapped, sharded over the dp x cp ranks, and the batches are cut before the step
            compose.parallelize(stage.piece, cfg, grid, shard=grid.size("dp") * grid.size("cp") > 1, root=stage,
                                loss_parallel=False, reshard_after_forward=False, cut_sequence=False)
    return stages


def _context_cut(stages: list[StageModule], cfg, grid, device: torch.device):
    """(cut, group) under context parallelism: `cut` takes a batch's (samples, sequence) tensor to this cp rank's
    part of every sequence (the layout cp_scratch's wrapper uses), the first stage is given its tokens' positions,
    and `group` is the cp line whose losses are averaged; (identity, None) without it."""
    cp = grid.size("cp")
    if cp == 1:
        return (lambda t: t), None
    from multigpu.models import default_seq_len
    from multigpu.strategies import cp_attention as cpa
    from multigpu.strategies.cp_scratch import context_group, options

    balance, rank = options(cfg)[1], grid.coord("cp")
    seq_len = cfg.seq_len or default_seq_len(cfg.model)
    for stage in stages:
        if stage.index == 0:
            stage.position_ids = cpa.positions(seq_len, cp, rank, balance, device)
    return partial(cpa.split_sequence, dim=1, cp=cp, rank=rank, balance=balance), context_group(grid)


def sync_tied(stages: list[StageModule], group) -> None:
    """Give both copies of a tied embedding the sum of their gradients: locally when this
    rank holds the first and the last stage (V placement), else with the embedding group."""
    first = next((s for s in stages if s.index == 0), None)
    last = next((s for s in stages if s.index == s.num_stages - 1), None)
    if first is last or not stages[0].piece.cfg.tie_embeddings:  # one stage: still one weight
        return
    if first is not None and last is not None:
        a, b = local_grad(first.piece.wte.weight), local_grad(last.piece.lm_head.weight)
        total = a + b  # both copies are cut alike: add the local shards
        a.copy_(total)
        b.copy_(total)
        return
    for s in (first, last):
        if s is not None:
            sync_tied_embedding(s.piece, group, s.index, s.num_stages)


def microbatch_problem(name: str, m: int, p: int) -> str | None:
    """Why schedule `name` cannot run m micro-batches on p ranks, or None."""
    schedule = SCHEDULES[name]
    stages = p * schedule.stages_per_rank
    if schedule.needs_m_ge_stages and m < stages:
        return (f"{name} needs at least as many micro-batches as stages: grad_accum_steps={m} < {stages} "
                f"stages ({p} ranks x {schedule.stages_per_rank}); use grad_accum_steps >= {stages}"
                + (" or pp-gpipe, which accepts fewer" if name != "pp-gpipe" else ""))
    rounds = max(1, m // p)
    if schedule.cls is ScheduleInterleaved1F1B and m % rounds:  # the library's own rule
        good = [k for k in range(m, 4 * m) if k % max(1, k // p) == 0][0]
        return (f"{name} runs the micro-batches in rounds of p={p}: grad_accum_steps={m} is not a multiple "
                f"of its {rounds} rounds; use e.g. grad_accum_steps={good}")
    return None


def _n_layer(model_name: str) -> int | None:
    from multigpu.models import GPT_SIZES, read_config_file

    if model_name in GPT_SIZES:
        return GPT_SIZES[model_name].n_layer
    return read_config_file(model_name).get("n_layer")


def config_problems(cfg) -> list[str]:
    """What RunConfig.validate reports before any process starts."""
    from multigpu.models import family

    name, m = cfg.strategy, cfg.grad_accum_steps
    if name not in SCHEDULES:
        return [f"no pipeline schedule is called {name!r}; choose one of: {', '.join(SCHEDULES)}"]
    p = cfg.degrees["pp"]
    problems = []
    if cfg.extra.get("sequence_parallel") and cfg.degrees["tp"] > 1:
        problems.append(f"{name} does not run sequence parallelism inside its stages; drop --sequence-parallel")
    if family(cfg.model) != "gpt":
        return problems + [f"{name} cuts the package's GPT into stages; {cfg.model!r} is a {family(cfg.model)} "
                           "model: use a gpt-* preset"]
    schedule = SCHEDULES[name]
    stages, n_layer = p * schedule.stages_per_rank, _n_layer(cfg.model)
    if n_layer is not None and stages > n_layer:
        problems.append(f"{name} cuts {cfg.model} into {stages} stages ({p} ranks x {schedule.stages_per_rank}) "
                        f"but it has {n_layer} blocks; use at most {n_layer // schedule.stages_per_rank} "
                        f"process(es) or a deeper model{deeper_preset(stages)}")
    why = microbatch_problem(name, m, p)
    if why:
        problems.append(why)
    return problems


def defaults(cfg) -> dict:
    """What this run needs that the package's defaults do not give (config.with_strategy_defaults
    applies it where the reader chose nothing): a GPT with a block for every stage, and the
    fewest micro-batches the schedule takes that split the global batch."""
    p, schedule = cfg.degrees["pp"], SCHEDULES[cfg.strategy]
    wanted = {}
    model = deep_enough(cfg.model, p * schedule.stages_per_rank)
    if model:
        wanted["model"] = model
    per_micro = cfg.degrees["dp"]
    m = next((m for m in range(cfg.grad_accum_steps, 4 * p * schedule.stages_per_rank + 1)
             if microbatch_problem(cfg.strategy, m, p) is None and cfg.global_batch_size % (per_micro * m) == 0),
             cfg.grad_accum_steps)  # none: validate says why, with the numbers
    if m != cfg.grad_accum_steps:
        wanted["grad_accum_steps"] = m
    return wanted


def prepare(model: nn.Module, cfg, rt) -> Parallelized:
    grid, name = rt.grid, cfg.strategy
    if not isinstance(model, GPT):
        raise ValueError(f"{name} cuts the package's GPT into stages, not a {type(model).__name__}")
    # m suits the schedule: config_problems (RunConfig.validate) refused it otherwise, before any process started
    schedule, p, rank, m = SCHEDULES[name], grid.size("pp"), grid.coord("pp"), cfg.grad_accum_steps
    stages = build_stages(model, schedule, rank, p, rt.device, cfg, grid)
    num_stages = stages[0].num_stages
    cut, cp_group = _context_cut(stages, cfg, grid, rt.device)
    last_rank = stage_rank(schedule, num_stages - 1, p)
    # the embedding group joins pipeline ranks 0 and p-1: needed only when those are the two
    # ranks holding the first and the last stage (creating a group is collective: all call it)
    tied_group = tied_embedding_group(grid) if schedule.placement == "loop" and p > 1 else None
    pipeline_stages = [PipelineStage(s, s.index, num_stages, rt.device, group=grid.group("pp")) for s in stages]
    clock = ActionClock(rt.device)  # every action of the last step, as the from-scratch pipeline logs them
    for ps in pipeline_stages:
        log_actions(ps, clock)
    loss_fn = lambda logits, labels: loss_from_logits(logits, labels) / m  # noqa: E731
    if schedule.stages_per_rank == 1:
        runner = schedule.cls(pipeline_stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        runner = schedule.cls(pipeline_stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    local = nn.ModuleList(stages)
    optimizer = build_optimizer(local.parameters(), cfg)
    has_first, has_last = stages[0].index == 0, stages[-1].index == num_stages - 1

    def train_step(par, micro_batches, autocast_dtype=None, before_forward=lambda i: None) -> float:
        if len(micro_batches) != m:
            raise ValueError(f"the schedule was built for {m} micro-batches, got {len(micro_batches)}")
        par.zero_grad()
        clock.start_step()
        for s in stages:
            s.autocast_dtype = autocast_dtype
        before_forward(0)
        # the schedule cuts the whole batch into m micro-batches again (tensor_split: the same ones)
        ids = cut(torch.cat([b["input_ids"] for b in micro_batches])) if has_first else None
        labels = cut(torch.cat([b["labels"] for b in micro_batches])) if has_last else None
        losses: list[torch.Tensor] = []
        runner.step(*([ids] if has_first else []), target=labels, losses=losses, return_outputs=False)
        sync_tied(stages, tied_group)
        par.optimizer.step()
        step_loss = 0.0
        if has_last:  # summed on the device, in float64 one addition at a time as the shared loop
            # sums, and read once, after the broadcast: no host sync per micro-batch
            step_loss = torch.zeros((), dtype=torch.float64, device=rt.device)
            for loss in losses:
                step_loss = step_loss + loss.detach().double()
            if cp_group is not None:  # each cp rank's loss is its own tokens': their mean is the sequences'
                dist.all_reduce(step_loss, group=cp_group)
                step_loss = step_loss / grid.size("cp")
        return loss_to_all(step_loss, grid, rt.device, src=last_rank)

    # no memory tracker: its module hooks (register_multi_grad_hook) refuse the autograd.grad
    # the library's stages call in backward ("A leaf node was passed to
    # _will_engine_execute_node ..."); memory is recorded as not measured
    return Parallelized(module=local, optimizer=optimizer, model=local, train_step=train_step,
                        gather_state_dict=lambda: pipeline_state_dict([s.piece for s in stages], grid),
                        counts_own_memory=True,
                        report=lambda: {"schedule": name, "schedule_class": schedule.cls.__name__,
                                        "num_stages": num_stages, "microbatches": m,
                                        "stages_on_this_rank": [s.index for s in stages],
                                        "events": list(clock.events), "clock": clock.clock,
                                        "step_start_unix": clock.start_unix})


def log_actions(stage: PipelineStage, clock: ActionClock) -> None:
    """Wrap a PipelineStage's per-chunk methods so that each action lands in `clock`'s log
    (`clock.events`: {"stage", "action", "micro", "start_s", "end_s"}, seconds from the step's
    start, `clock.start_step()`; on a GPU the GPU's times): F (forward_one_chunk), B
    (backward_one_chunk: the input's gradient, and the weights' too unless the schedule
    defers them), W (backward_weight_one_chunk, zero-bubble schedules)."""

    def wrapped(method, action):
        def run(chunk, *args, **kwargs):
            start = clock.now()
            out = method(chunk, *args, **kwargs)
            clock.log(start, stage=stage.stage_index, action=action, micro=chunk)
            return out
        return run

    stage.forward_one_chunk = wrapped(stage.forward_one_chunk, "F")
    stage.backward_one_chunk = wrapped(stage.backward_one_chunk, "B")
    stage.backward_weight_one_chunk = wrapped(stage.backward_weight_one_chunk, "W")


def traced_split(model: nn.Module | None = None, example: torch.Tensor | None = None,
                 split_before: tuple[str, ...] = ("4",)) -> dict:
    """The automatic split: `pipeline()` traces `model` (with torch.export, on `example`)
    and cuts the graph before each module named in `split_before`. By default the model is
    a plain `nn.Sequential` of 4 x (Linear, Tanh), cut before its third Linear ("4"); the
    package's GPT traces too (`split_before=("blocks.2",)`). Returns what it became: the
    stages, the parameters each holds, their generated code, and whether the stages chained
    by hand compute what the whole model computes. One process: nothing distributed
    happens until `pipe.build_stage(i, device, group)`."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    if model is None:
        torch.manual_seed(0)
        model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.Tanh())])
        example = torch.randn(4, 8)
    pipe = pipeline(model, mb_args=(example,), split_spec={name: SplitPoint.BEGINNING for name in split_before})
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    out = example
    for stage in stages:
        out = stage(out)
    with torch.no_grad():
        whole = model(example)
    return {"num_stages": pipe.num_stages,
            "parameters": [[n for n, _ in stage.named_parameters()] for stage in stages],
            "matches_whole_model": bool(torch.allclose(out, whole)),
            "code": [stage.code.strip() for stage in stages]}
