"""Expert parallelism from scratch: a mixture of experts' experts cut over data-parallel ranks.

A MoE layer (moe.py) holds E experts, and each token needs only k of them. Data parallelism
would keep all E on every rank; expert parallelism gives each of ep ranks E/ep of them and
sends every token to the rank of each expert it chose, with one all-to-all, and the outputs
back with another (GShard, Lepikhin et al. 2020; Switch; DeepSpeed-MoE; torchtitan). Everything
else (attention, embeddings, the router, shared experts) stays data parallel: the ep ranks are
data-parallel ranks that share out the experts, so ep divides dp.

Per MoE layer, forward (`ExpertDispatch`):
1. the router chooses; the kept (token, expert) assignments are sorted by expert (moe.MoE);
2. the counts go first (all-to-all of E numbers: how many tokens each rank sends to each of
   another's experts), since each rank must know how much it will receive;
3. dispatch: the tokens, all-to-all with those splits (k x d_model values per token leave);
4. each rank runs its experts on what arrived, regrouped expert by expert;
5. combine: the outputs go back by the reverse all-to-all, and are summed with the router's
   weights where they came from. Backward runs the same two all-to-alls with the splits swapped.

The gradients. Each rank's loss is the mean over its own tokens; the loss of the whole batch
is the mean of those, so its gradient is the mean over the dp ranks of theirs. For the dense
part that is the usual average over dp (GradBuckets, as ddp-scratch). An expert's gradient
arrives already summed over the ep ranks whose tokens it served (the all-to-all's backward
brought theirs home); the other copies of the same expert (dp/ep of them, one per ep group)
hold the sums of the other groups. So the expert gradients are summed over those copies and
divided by dp, not by the dp/ep copies: dividing by the group's own size would make experts
learn ep times too fast under SGD (Adam, which divides by the gradients' own scale, would hide
it), and nothing would fail: which is why parity is tested against one device, with SGD.

`ep-scratch --world-size 4` is dp 4 = ep 4; `--ep 2` is dp 4 with two copies of each half of the
experts; `--ep 1` is data parallel of the same model (all experts everywhere), the baseline.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.distributed as dist

from multigpu import moe
from multigpu.strategies import Parallelized, build_optimizer
from multigpu.strategies.ddp_scratch import GradBuckets


def moe_config(model: str):
    """The MoEConfig of a preset (None: a dense model)."""
    from multigpu.models import GPT_SIZES

    return GPT_SIZES[model].moe if model in GPT_SIZES else None


def hf_experts(model: str) -> int | None:
    """The experts per layer of a Hugging Face Mixtral config.json (None: not one). Its sparse blocks
    route as moe.MoE does without a capacity (softmax, top k, renormalised), and keep their
    balancing loss out of the loss unless asked: it trains at parity under every data-parallel
    strategy, all experts on every rank, and over ep ranks with DeepSpeed-MoE (deepspeed-moe)."""
    from multigpu.models import PRESETS, read_config_file

    if model in PRESETS or not model.endswith(".json"):
        return None
    config = read_config_file(model)
    return config.get("num_local_experts") if config["model_type"] == "mixtral" else None


def expert_problems(cfg) -> list[str]:
    """What keeps `cfg` from training its mixture of experts (every run: RunConfig.validate)."""
    from multigpu.strategy_table import STRATEGY_TABLE

    layer, extra = moe_config(cfg.model), cfg.extra or {}
    asked = [f"--{name.replace('_', '-')}" for key, name in moe.OPTIONS.items() if key in extra]
    verb = "routes" if len(asked) == 1 else "route"
    takes = [name for name, s in STRATEGY_TABLE.items() if "ep" in s.combines]
    if layer is None and (experts := hf_experts(cfg.model)):
        ep = cfg.degrees.get("ep", 1)
        if asked:
            return [f"{' and '.join(asked)} {verb} this package's mixture of experts; {cfg.model} is a Hugging Face "
                    "Mixtral, which routes as its config.json says (num_experts_per_tok): leave them out"]
        if ep > 1 and cfg.strategy != "deepspeed-moe" or cfg.strategy == "ep-scratch":
            return [f"{cfg.model} is a Hugging Face Mixtral: its experts go over ranks with --strategy "
                    f"deepspeed-moe (DeepSpeed-MoE's layer); {cfg.strategy}{' --ep' if ep > 1 else ''} cuts "
                    "this package's presets' experts (gpt-moe-tiny, gpt-moe-small)"]
        if experts % ep:
            fits = " or ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
            return [f"ep {ep} does not divide the {experts} experts of each layer of {cfg.model}: every rank holds "
                    f"an equal share; use --ep {fits}"]
        return []
    if layer is None:
        problems = [f"{' and '.join(asked)} {verb} a mixture of experts; {cfg.model} is not one of this package's "
                    "mixture-of-experts presets (gpt-moe-tiny, gpt-moe-small): use one, or leave them out"
                    ] if asked else []
        if STRATEGY_TABLE[cfg.strategy].spans_experts or cfg.degrees.get("ep", 1) > 1:
            problems.append(f"{cfg.strategy}{' --ep' if cfg.degrees.get('ep', 1) > 1 else ''} cuts a mixture of "
                            f"experts' experts over ranks; {cfg.model} has none: use --model gpt-moe-tiny or "
                            "gpt-moe-small")
        return problems
    if cfg.strategy not in ("single", *takes):
        return [f"a mixture of experts trains here with single or {' or '.join(takes)} (with --ep, or --ep 1 for "
                f"plain data parallel of it): its balancing loss counts the whole batch's tokens, which "
                f"{cfg.strategy!r} would count rank by rank"]
    top_k = extra.get("moe_top_k", layer.top_k)
    if any(cfg.degrees.get(d, 1) > 1 for d in ("tp", "pp", "cp")) or extra.get("replicas", 1) != 1 \
            or extra.get("wrap", "blocks") != "blocks":
        return [f"{cfg.strategy} of a mixture of experts composes with --ep here, not yet with --tp, --cp, hybrid "
                "sharding or wrap 'root'"]
    problems = moe.options_problems(layer.experts, top_k, extra.get("moe_capacity_factor", layer.capacity_factor),
                                    extra.get("moe_aux_loss_coef", layer.aux_loss_coef))
    ep, dp = cfg.degrees.get("ep", 1), cfg.degrees["dp"]
    if layer.experts % ep:
        fits = [d for d in range(1, dp + 1) if layer.experts % d == 0 and dp % d == 0]
        given = "" if cfg.ep else f" (ep is every data-parallel rank, dp {dp}, unless --ep says otherwise)"
        problems.append(f"ep {ep}{given} does not divide the {layer.experts} experts of each layer: every rank holds "
                        f"an equal share; use --ep {' or '.join(map(str, fits))}")
    return problems


def defaults(cfg) -> dict:
    """What config.with_strategy_defaults picks where the reader chose nothing: a model with experts."""
    return {} if moe_config(cfg.model) else {"model": "gpt-moe-tiny"}


def expert_mesh(grid, ep: int):
    """The data-parallel ranks as a (copies, ep) device mesh: each row a run of ep consecutive
    ranks (inside a node on a GPU server: the all-to-all is the heaviest traffic) that share out
    the experts; each column the ranks at the same place in every run, which hold the same experts
    (FSDP shards them over it). The ranks of a mixture of experts are data-parallel ranks only
    (expert_problems), so the dp ranks are the world."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = grid.size("dp")
    return init_device_mesh(grid.device_type, (dp // ep, ep), mesh_dim_names=("copies", "ep"))


class _AllToAll(torch.autograd.Function):
    """Rows of `x` to the group's ranks, `sent[r]` of them to rank r, `received[r]` from rank r;
    its gradient goes back the same way with the splits swapped."""

    @staticmethod
    def forward(ctx, x, received: list[int], sent: list[int], group):
        ctx.splits, ctx.group = (sent, received), group
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        sent, received = ctx.splits
        back = grad.new_empty((sum(sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), sent, received, group=ctx.group)
        return back, None, None, None


class ExpertDispatch:
    """A MoE layer's `dispatch` over an ep group: tokens sorted by expert in, their experts'
    outputs out, in the same order (steps 2-5 above)."""

    def __init__(self, experts: moe.Experts, group):
        self.experts, self.group = experts, group
        self.ep = dist.get_world_size(group)

    def __call__(self, tokens: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        held = per_expert.numel() // self.ep
        to_each = per_expert.view(self.ep, held)  # [r, e]: tokens for rank r's e-th expert
        from_each = torch.empty_like(to_each)  # [s, e]: tokens rank s sends to my e-th expert
        dist.all_to_all_single(from_each, to_each.contiguous(), group=self.group)  # 2. the counts first
        sent, got = to_each.sum(dim=1).tolist(), from_each.tolist()
        received = [sum(row) for row in got]
        arrived = _AllToAll.apply(tokens, received, sent, self.group)  # 3. dispatch: by source, then expert
        # 4. regroup expert by expert (each expert's tokens from rank 0, then rank 1, ...), run, put back:
        # block (s, e) of the arrivals starts at `start`; taken in (e, s) order, it is `length` rows long
        blocks = [(s, e) for e in range(held) for s in range(self.ep)]
        start = [sum(received[:s]) + sum(got[s][:e]) for s, e in blocks]
        length = [got[s][e] for s, e in blocks]
        jumps = torch.tensor([b - a for a, b in zip(accumulate([0, *length]), start)], device=tokens.device)
        index = torch.arange(sum(length), device=tokens.device) + jumps.repeat_interleave(
            torch.tensor(length, device=tokens.device), output_size=sum(length))
        out = self.experts(arrived[index], [sum(got[s][e] for s in range(self.ep)) for e in range(held)])
        back = torch.empty_like(out).index_copy(0, index, out)
        return _AllToAll.apply(back, sent, received, self.group)  # 5. combine: home again


def parallelize(model, grid, ep: int):
    """Cut every MoE layer's experts over this rank's ep group, in place, and hook its dispatch
    and its counts (summed over the dp ranks); return the (copies, ep) mesh (None for ep 1: every
    rank holds every expert, plain data parallel)."""
    mesh = expert_mesh(grid, ep) if ep > 1 else None
    for layer in moe.layers(model):
        layer.reduce_counts = _summed(grid.group("dp"))
        if mesh is None:
            continue
        group, experts = mesh.get_group("ep"), layer.experts
        me, held = dist.get_rank(group), layer.experts_total // ep
        with torch.no_grad():
            for name, p in list(experts.named_parameters()):
                setattr(experts, name, torch.nn.Parameter(p[me * held:(me + 1) * held].clone()))
        layer.dispatch = ExpertDispatch(experts, group)
    return mesh


def _summed(group):
    def reduce(counts):  # the whole batch's counts (no gradient flows through counts)
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        return counts
    return reduce


def gather_experts(model, state: dict) -> dict:
    """`state` (the model's, each rank's experts whole) with every layer's experts gathered from
    its ep group, in rank order: the whole model's."""
    layers = moe.layers(model)
    if not layers or layers[0].dispatch is None:
        return state
    state, group = dict(state), layers[0].dispatch.group
    ep = dist.get_world_size(group)
    for prefix, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, moe.MoE)):
        prefix = prefix.replace("_checkpoint_wrapped_module.", "")  # state_dict's names leave the wrapper out
        for name, p in layer.experts.named_parameters():
            key = f"{prefix}.experts.{name}"
            if key not in state:
                raise RuntimeError(f"expert parallelism: experts {key!r}, which the model's state_dict does not name")
            mine = state[key].to(p.device)  # this rank's slice (under FSDP, gathered whole over its copies)
            parts = [torch.empty_like(mine) for _ in range(ep)]
            dist.all_gather(parts, mine.contiguous(), group=group)
            state[key] = torch.cat(parts)
    return state


def shard_experts(model, cfg, grid, **fsdp) -> None:
    """fsdp --ep: each layer's slice of the experts its own FSDP unit over the ranks holding the same
    slice (before the blocks are wrapped, which then leave it out), its gradients summed over them and
    divided by dp (the dp/ep copies would average them: see the module's docstring); `fsdp`:
    fully_shard's keyword arguments."""
    from torch.distributed.fsdp import fully_shard

    mesh = parallelize(model, grid, cfg.degrees.get("ep", 1))
    if mesh is None:
        return
    for layer in moe.layers(model):
        fully_shard(layer.experts, mesh=mesh["copies"], **fsdp)
        layer.experts.set_gradient_divide_factor(float(grid.size("dp")))
        # a sum, then the division: gloo has no PREMUL_SUM. Not on a mesh of one rank, which sends nothing: there
        # torch 2.13's FSDP divides by the factor twice when the sum is forced (found by the parity test)
        layer.experts.set_force_sum_reduction_for_comms(mesh["copies"].size() > 1)


def prepare(model, cfg, rt) -> Parallelized:
    dp_group, ep = rt.grid.group("dp"), cfg.degrees.get("ep", 1)
    mesh = parallelize(model, rt.grid, ep)
    copies = mesh.get_group("copies") if mesh is not None else dp_group
    expert_params = {id(p) for layer in moe.layers(model) for p in layer.experts.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_params]
    experts = [p for p in model.parameters() if id(p) in expert_params]
    with torch.no_grad():  # the same start everywhere: dense weights over dp, experts over their copies
        for params, over in ((dense, dp_group), (experts, copies)):
            for p in params:
                dist.broadcast(p, group=over, group_src=0)
    dp = dist.get_world_size(dp_group)
    buckets = [GradBuckets(dense, dp_group, cfg.bucket_cap_mb),
               GradBuckets(experts, copies, cfg.bucket_cap_mb, divide_by=dp)]  # summed over copies, / dp
    optimizer = build_optimizer(dense + experts, cfg)

    def step():
        for b in buckets:
            b.finish()
        optimizer.step()

    def no_sync():
        from contextlib import ExitStack

        stack = ExitStack()
        for b in buckets:
            stack.enter_context(b.no_sync())
        return stack

    held = moe.layers(model)[0].experts.fc_weight.shape[0]
    return Parallelized(module=model, optimizer=optimizer, model=model, no_sync=no_sync, step=step,
                        tracked=[f for b in buckets for f in b.flat],
                        gather_state_dict=lambda: gather_experts(model, model.state_dict()),
                        report=lambda: {"ep": ep, "experts_per_rank": held},
                        checkpoint_names="local" if ep > 1 else "canonical")  # rows of experts: each rank's
