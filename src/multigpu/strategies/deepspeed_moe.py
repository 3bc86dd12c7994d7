"""Expert parallelism with a library: DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE`) in place
of every MoE layer, trained by DeepSpeed's engine (Rajbhandari et al. 2022).

The same model as `ep-scratch` trains (moe.py's presets): each layer's router becomes DeepSpeed's
gate (`wg`, a linear layer without bias, computed in fp32 outside autocast as ours is: DeepSpeed
casts its input and weight to fp32, but under bf16-mixed the engine's autocast would still run the
product in bf16, so the gate runs with autocast off, `_outside_autocast`), and expert e's rows of the
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
- **The balancing loss**: DeepSpeed's gate returns GShard's form, each rank over its own tokens and
  first choices only (`l_aux = E^2 mean(me * ce)` for k = 2), not Switch's over the whole batch's
  assignments: the same coefficient would give another loss. The layer sets it aside and adds the
  package's (`moe.MoE`'s: Switch's, the counts summed over the data-parallel ranks), computed from
  the gate's own weight, so the loss and its gradient are one device's at any coefficient.
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
import torch.nn.functional as F
from torch import nn

from multigpu import moe
from multigpu.strategies import Parallelized, build_optimizer
from multigpu.strategies.deepspeed import config as deepspeed_config
from multigpu.strategies.deepspeed import import_deepspeed
from multigpu.strategies.ep_scratch import _summed, defaults, expert_problems  # noqa: F401 - the config reads them


class SwiGLUExpert(nn.Module):
    """One expert of a Hugging Face Mixtral as a module of its own (DeepSpeed's layer copies one per
    local expert): rows e of the experts' stacked `gate_up_proj` (2 d_ff, d) and `down_proj` (d, d_ff)."""

    def __init__(self, d_model: int, d_ff: int, act):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)
        self.act = act

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def _layer_kind(module: nn.Module) -> str | None:
    """"package" (moe.MoE), "mixtral" (a Hugging Face Mixtral's sparse block) or None."""
    if isinstance(module, moe.MoE):
        return "package"
    return "mixtral" if type(module).__name__ == "MixtralSparseMoeBlock" else None


class LibraryMoE(moe.MoE):
    """A MoE layer computed by DeepSpeed-MoE, holding the weights of `ours` (this package's moe.MoE or
    a Hugging Face Mixtral's sparse block), this rank's experts of them: those of ep rank `ep_rank`.
    It is a moe.MoE to the rest of the package: it sets `aux_loss`, appends each forward's tokens per
    expert and dropped to `load`, and its `capacity_factor`, `top_k` and `aux_loss_coef` are the
    layer's (a Mixtral: no capacity, and its balancing loss is not in this package's loss)."""

    def __init__(self, ours: nn.Module, ep: int, ep_rank: int, deepspeed):
        nn.Module.__init__(self)
        self.kind = _layer_kind(ours)
        if self.kind == "package":
            E, k, router = ours.experts_total, ours.top_k, ours.router.weight
            self.capacity_factor, self.aux_loss_coef = ours.capacity_factor, ours.aux_loss_coef
            d_model, d_ff = ours.experts.fc_weight.shape[1:]
            template = moe.MLP(d_model, d_ff)
            x = ours.experts
            rows = lambda e: {"fc.weight": x.fc_weight[e].T, "fc.bias": x.fc_bias[e],  # noqa: E731
                              "proj.weight": x.proj_weight[e].T, "proj.bias": x.proj_bias[e]}
            self.shared = ours.shared
        else:
            E, k, router = ours.gate.num_experts, ours.gate.top_k, ours.gate.weight
            self.capacity_factor, self.aux_loss_coef = None, 0.0
            d_ff, d_model = ours.experts.down_proj.shape[1:][::-1]
            template = SwiGLUExpert(d_model, d_ff, ours.experts.act_fn)
            x = ours.experts
            rows = lambda e: {"gate_up.weight": x.gate_up_proj[e], "down.weight": x.down_proj[e]}  # noqa: E731
            self.shared = nn.ModuleList()
        self.experts_total, self.top_k = E, k
        factor = self.capacity_factor or 1.0  # not read without a capacity (drop_tokens=False)
        self.library = deepspeed.moe.layer.MoE(
            hidden_size=d_model, expert=template, num_experts=E, ep_size=ep, k=k,
            capacity_factor=factor, eval_capacity_factor=factor, min_capacity=0,
            drop_tokens=self.capacity_factor is not None, use_rts=False, top2_2nd_expert_sampling=False)
        held = E // ep
        gate = self.library.deepspeed_moe.gate
        gate.forward = _outside_autocast(gate.forward)  # on the instance: the names in its state stay
        with torch.no_grad():
            gate.wg.weight.copy_(router)
            for j, expert in enumerate(self.library.deepspeed_moe.experts.deepspeed_experts):
                params = dict(expert.named_parameters())
                for name, value in rows(ep_rank * held + j).items():
                    params[name].copy_(value)
        self.reduce_counts = None
        self.aux_loss, self.load, self.aux = None, [], []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        out, _, counts = self.library(x)  # (its balancing loss, GShard's per rank, is not the package's)
        self.aux_loss = self._balancing_loss(x)
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

    def _balancing_loss(self, x: torch.Tensor) -> torch.Tensor:
        """moe.MoE's balancing loss (Switch's): E x sum_i f_i P_i times the coefficient, f_i the share of the
        whole batch's (token, choice) assignments to expert i (counts summed over the data-parallel ranks,
        `reduce_counts`), P_i the mean probability the gate gives expert i on this rank's tokens, in fp32 from
        the gate's weight, as DeepSpeed's gate and moe.MoE's router compute their scores."""
        if not self.aux_loss_coef:
            return x.new_zeros((), dtype=torch.float32)
        E, tokens = self.experts_total, x.reshape(-1, x.shape[-1])
        weight = self.library.deepspeed_moe.gate.wg.weight
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(tokens.float(), weight.float()).softmax(dim=-1)
        chosen = probs.topk(self.top_k, dim=-1).indices
        counts = torch.cat([torch.bincount(chosen.view(-1), minlength=E), chosen.new_zeros(1)])
        if self.reduce_counts is not None:
            counts = self.reduce_counts(counts)
        share = counts[:E].float() / counts[:E].sum()
        return self.aux_loss_coef * E * (share * probs.mean(dim=0)).sum()

    def whole_state(self, group) -> dict:
        """This layer's router and experts under the names of the layer it replaced, every ep rank's
        experts gathered in rank order (ep ranks are consecutive: `group`, None for ep 1)."""
        experts = self.library.deepspeed_moe.experts.deepspeed_experts
        router = self.library.deepspeed_moe.gate.wg.weight.detach()
        if self.kind == "package":
            mine = {"router.weight": None,
                    "experts.fc_weight": [x.fc.weight.T for x in experts],
                    "experts.fc_bias": [x.fc.bias for x in experts],
                    "experts.proj_weight": [x.proj.weight.T for x in experts],
                    "experts.proj_bias": [x.proj.bias for x in experts]}
        else:
            mine = {"gate.weight": None, "experts.gate_up_proj": [x.gate_up.weight for x in experts],
                    "experts.down_proj": [x.down.weight for x in experts]}
        out = {}
        for name, rows in mine.items():
            if rows is None:
                out[name] = router
                continue
            rows = torch.stack(rows).detach().contiguous()
            parts = [rows]
            if group is not None:
                parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, rows, group=group)
            out[name] = torch.cat(parts)
        return out


def _outside_autocast(forward):
    """A gate's forward with autocast off: its fp32 product stays fp32 under bf16-mixed, as moe.MoE's
    router's does (in bf16 the scores tie, and which expert a tie goes to depends on the batch's shape)."""
    def run(x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return forward(x, *args, **kwargs)

    return run


def swap_layers(model: nn.Module, ep: int, ep_rank: int, deepspeed) -> list[LibraryMoE]:
    """Every MoE layer of `model` (moe.MoE, a Mixtral's sparse block) replaced, in place, by a
    LibraryMoE holding its weights."""
    swapped = []
    for name, module in list(model.named_modules()):
        if _layer_kind(module) is not None:
            parent_name, _, leaf = name.rpartition(".")
            device = next(module.parameters()).device
            layer = LibraryMoE(module, ep, ep_rank, deepspeed).to(device)
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)
            swapped.append(layer)
    return swapped


def gather_experts(model: nn.Module, group) -> dict:
    """The model's state under the names of the model before the swap, every layer's experts gathered
    from the ep ranks in rank order."""
    out = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.state_dict().items()
           if ".library." not in k}
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, LibraryMoE)):
        prefix = name.replace("_checkpoint_wrapped_module.", "")
        out.update({f"{prefix}.{k}": v for k, v in layer.whole_state(group).items()})
    return out


def prepare(model, cfg, rt) -> Parallelized:
    deepspeed = import_deepspeed(rt.device.type)
    from deepspeed.utils import groups

    ep = cfg.degrees.get("ep", 1)
    # DeepSpeed's expert-parallel groups are runs of ep consecutive ranks (use_data_before_expert_parallel_
    # off): rank r holds the experts of ep rank r % ep, checked below once the engine has made the groups
    layers = swap_layers(model, ep, rt.rank % ep, deepspeed)
    if not layers:
        raise RuntimeError(f"deepspeed-moe: {cfg.model} has no MoE layer this package can hand to DeepSpeed-MoE")
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
