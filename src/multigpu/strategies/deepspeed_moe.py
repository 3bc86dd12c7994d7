"""Expert parallelism with a library: DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE`) in place
of every MoE layer, trained by DeepSpeed's engine (Rajbhandari et al. 2022).

The same model as `ep-scratch` trains (moe.py's presets): each layer's router becomes DeepSpeed's
gate (`wg`, a linear layer without bias, computed in fp32 as ours is), and expert e's rows of the
stacked weights become the e-th expert of the ep rank that holds it (a copy of moe.MLP each:
DeepSpeed deep-copies the module it is given once per local expert). DeepSpeed then does all of
ep-scratch's steps itself:

1. the gate chooses top-k (`top1gating`, `top2gating`, `topkgating`), renormalising the k weights
   as Mixtral does (k > 1) or keeping the score (k = 1), and gives each assignment a slot in its
   expert's buffer of C places;
2. the tokens go into an (E, C, d_model) buffer, and one all-to-all sends each ep rank its
   experts' rows of it (`_AllToAll`, the buffer's own size, so no counts are exchanged first);
3. its experts run, and the reverse all-to-all brings the outputs home, weighted by the gate;
4. the engine averages the dense gradients over every rank and the experts' over the ranks that
   hold the same experts, dividing both by the data-parallel size (`_reduce_expert_gradients`:
   the division ep-scratch makes by hand, for the reason its docstring gives).

Where the library differs from this package's layer, and what follows:
- **Capacity**: C is counted over a rank's whole micro-batch, not per sequence, and with a
  capacity factor the tokens kept within it are chosen in no set order (`torch.topk` over equal
  scores for k = 1). So with a capacity factor the dropped tokens depend on how the batch is cut:
  no parity with one device there, and the chapter says so. Without one (`drop_tokens=False`)
  C is the busiest expert's count, the same on every ep rank (an all-reduce of the maximum):
  nothing is dropped, and the run trains as one device does (tests/test_parity.py).
- **The balancing loss** is GShard's form, each rank over its own tokens and first choices only
  (`l_aux = E^2 mean(me * ce)` for k = 2), not Switch's over the whole batch's assignments: the
  same coefficient gives another loss. Parity is tested with the coefficient 0.
- **Padding**: every expert computes C rows, the empty ones zeros (their outputs are weighted 0):
  the work and the all-to-all's bytes follow the busiest expert, not the tokens.
- The second choice is the plain top-2 (`top2_2nd_expert_sampling=False`; DeepSpeed's default
  samples it with Gumbel noise) and no random token selection (`use_rts=False`).

DeepSpeed's engine runs it at ZeRO stage 0 here (every rank holds the dense weights and their
optimizer state whole; its ZeRO stages need the optimizer's parameter groups split by expert
group). It saves its checkpoints itself (`checkpoint_names="deepspeed"`): the experts of each ep
rank in files of their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from multigpu import moe
from multigpu.strategies import Parallelized, build_optimizer
from multigpu.strategies.deepspeed import config as deepspeed_config
from multigpu.strategies.deepspeed import import_deepspeed
from multigpu.strategies.ep_scratch import _summed, defaults, expert_problems  # noqa: F401 - the config reads them


def config_problems(cfg) -> list[str]:
    return []  # expert_problems (every run) holds what a MoE and --ep need


class LibraryMoE(moe.MoE):
    """A MoE layer computed by DeepSpeed-MoE, holding the weights of `ours` (this rank's experts of
    them: those of ep rank `ep_rank`). It is a moe.MoE to the rest of the package: it sets
    `aux_loss`, appends each forward's tokens per expert and dropped to `load`, and its
    `capacity_factor`, `top_k` and `aux_loss_coef` are the layer's."""

    def __init__(self, ours: moe.MoE, ep: int, ep_rank: int, deepspeed):
        nn.Module.__init__(self)
        E, k = ours.experts_total, ours.top_k
        self.experts_total, self.top_k = E, k
        self.capacity_factor, self.aux_loss_coef = ours.capacity_factor, ours.aux_loss_coef
        d_model, d_ff = ours.experts.fc_weight.shape[1:]
        factor = ours.capacity_factor or 1.0  # not read without a capacity (drop_tokens=False)
        self.library = deepspeed.moe.layer.MoE(
            hidden_size=d_model, expert=moe.MLP(d_model, d_ff), num_experts=E, ep_size=ep, k=k,
            capacity_factor=factor, eval_capacity_factor=factor, min_capacity=0,
            drop_tokens=ours.capacity_factor is not None, use_rts=False, top2_2nd_expert_sampling=False)
        held = E // ep
        with torch.no_grad():
            self.library.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
            for j, expert in enumerate(self.library.deepspeed_moe.experts.deepspeed_experts):
                e = ep_rank * held + j
                expert.fc.weight.copy_(ours.experts.fc_weight[e].T)
                expert.fc.bias.copy_(ours.experts.fc_bias[e])
                expert.proj.weight.copy_(ours.experts.proj_weight[e].T)
                expert.proj.bias.copy_(ours.experts.proj_bias[e])
        self.shared = ours.shared
        self.reduce_counts = None
        self.aux_loss, self.load, self.aux = None, [], []
        self.ep, self.ep_rank = ep, ep_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        out, l_aux, counts = self.library(x)
        self.aux_loss = self.aux_loss_coef * l_aux
        if torch._C._current_graph_task_id() == -1:  # not activation checkpointing's recompute inside backward
            counts = counts.to(torch.int64)
            # kept per expert: its first C assignments (its slots are filled first choices first)
            places = moe.capacity(self.capacity_factor, B * T, self.top_k, self.experts_total)
            dropped = (counts - places).clamp(min=0).sum() if places is not None else counts.new_zeros(())
            counts = torch.cat([counts, dropped.view(1)])
            if self.reduce_counts is not None:  # the whole batch's, as moe.MoE reports them
                counts = self.reduce_counts(counts)
            self.load.append(counts.detach())
            self.aux.append(self.aux_loss.detach())
        for mlp in self.shared:
            out = out + mlp(x).to(out.dtype)
        return out.to(x.dtype)


def swap_layers(model: nn.Module, ep: int, ep_rank: int, deepspeed) -> list[LibraryMoE]:
    """Every moe.MoE of `model` replaced, in place, by a LibraryMoE holding its weights."""
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, moe.MoE):
            parent_name, _, leaf = name.rpartition(".")
            layer = LibraryMoE(module, ep, ep_rank, deepspeed).to(module.router.weight.device)
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)
            swapped.append(layer)
    return swapped


def gather_experts(model: nn.Module, group) -> dict:
    """The model's state under the single-device names (moe.MoE's: `router.weight`,
    `experts.fc_weight` stacked (E, d_model, d_ff), ...), every layer's experts gathered from the
    ep ranks in rank order."""
    state, out = model.state_dict(), {}
    ep = dist.get_world_size(group) if group is not None else 1
    for key, value in state.items():
        if ".library." not in key:
            out[key.replace("_checkpoint_wrapped_module.", "")] = value
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, LibraryMoE)):
        prefix = name.replace("_checkpoint_wrapped_module.", "")
        out[f"{prefix}.router.weight"] = layer.library.deepspeed_moe.gate.wg.weight.detach()
        experts = layer.library.deepspeed_moe.experts.deepspeed_experts
        mine = {"fc_weight": torch.stack([x.fc.weight.T for x in experts]),
                "fc_bias": torch.stack([x.fc.bias for x in experts]),
                "proj_weight": torch.stack([x.proj.weight.T for x in experts]),
                "proj_bias": torch.stack([x.proj.bias for x in experts])}
        for leaf, rows in mine.items():
            rows = rows.detach().contiguous()
            parts = [torch.empty_like(rows) for _ in range(ep)]
            if ep > 1:
                dist.all_gather(parts, rows, group=group)
            else:
                parts = [rows]
            out[f"{prefix}.experts.{leaf}"] = torch.cat(parts)
    return out


def prepare(model, cfg, rt) -> Parallelized:
    deepspeed = import_deepspeed(rt.device.type)
    from deepspeed.utils import groups

    ep = cfg.degrees.get("ep", 1)
    # DeepSpeed's expert-parallel groups are runs of ep consecutive ranks (use_data_before_expert_parallel_
    # off): rank r holds the experts of ep rank r % ep, checked below once the engine has made the groups
    layers = swap_layers(model, ep, rt.rank % ep, deepspeed)
    dp_group = rt.grid.group("dp")
    for layer in layers:
        layer.reduce_counts = _summed(dp_group)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model.parameters(), cfg),
                                                   config=deepspeed_config(cfg, 0))
    ep_group = groups._get_expert_parallel_group(f"ep_size_{ep}")
    if dist.get_rank(group=ep_group) != rt.rank % ep:
        raise RuntimeError(f"DeepSpeed put rank {rt.rank} at ep rank {dist.get_rank(group=ep_group)}, not "
                           f"{rt.rank % ep}: its experts were copied from the wrong rows")

    def backward(loss):
        engine.backward(loss, scale_wrt_gas=False)  # our loop already divides by the accumulation steps
        engine.step()  # an optimizer step only at the last micro-batch of the step

    inner = getattr(optimizer, "optimizer", optimizer)  # at stage 0 the engine may hand back the torch optimizer
    return Parallelized(module=engine, optimizer=inner, model=model, backward=backward,
                        step=lambda: None, zero_grad=lambda: None,
                        gather_state_dict=lambda: gather_experts(model, ep_group if ep > 1 else None),
                        report=lambda: {"ep": ep, "experts_per_rank": layers[0].experts_total // ep,
                                        "implementation": "DeepSpeed-MoE"},
                        checkpoint_names="deepspeed")
