"""A mixture-of-experts layer: the MLP of a transformer block replaced by E MLPs (experts) and a
router that sends each token to k of them.

Each token's router scores (a linear layer, softmax over the experts) choose its top k experts;
the token goes to each, and their outputs come back weighted by the scores (renormalised over the
k chosen when k > 1, as Mixtral does; the score itself when k = 1, as Switch does, so that the
router learns through the output). A layer of E experts holds E MLPs' parameters but computes only
k of them per token: parameters grow with E, work with k.

Three things make it trainable at scale, each here:
- **Capacity** (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2022): an expert takes at
  most C = ceil(capacity_factor x tokens x k / E) tokens of a group; the rest are dropped (their
  output is zero: the residual connection carries the token past the layer). The group is one
  sequence, and its tokens claim places first-choice first, in order (every token's first
  choice, then every second choice): where a sequence's tokens go never depends on how the
  batch is cut over ranks. capacity_factor None: no limit, nothing dropped.
- **The load-balancing loss** (Switch eq. 4, GShard): aux = E x sum_i f_i x P_i, f_i the share of
  the batch's (token, choice) assignments routed to expert i, P_i the mean router probability
  of expert i; 1 when the load is even, E/k when all go to the same k experts. It is added to the loss times
  aux_loss_coef (Switch's 0.01). f is counted over the whole batch: data-parallel ranks add their
  counts (`reduce_counts`, set by ep_scratch) before using them, so the loss, and its gradient,
  are those of one device holding the whole batch (the "global-batch" balance of Qiu et al. 2025).
- **Shared experts** (DeepSeekMoE, Dai et al. 2024): optional MLPs every token goes through.

Where the experts run is a swappable call (`dispatch`): on this device (None), or on the ranks
that hold them, reached by all-to-all (ep_scratch). The experts' weights are stacked, expert e
being row e of each, so an expert-parallel rank holds rows [first, first + E/ep) under the same
parameter names, as tensor parallelism keeps names while slicing.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    experts: int  # E, routed experts per layer
    top_k: int = 2  # experts per token
    d_ff: int | None = None  # each expert's hidden width (None: 4 x d_model, the dense MLP's)
    capacity_factor: float | None = None  # None: every token reaches its experts
    aux_loss_coef: float = 0.01  # Switch's alpha
    shared_experts: int = 0  # MLPs every token also goes through (DeepSeekMoE)

    def __post_init__(self):
        problems = options_problems(self.experts, self.top_k, self.capacity_factor, self.aux_loss_coef)
        if problems:
            raise ValueError("; ".join(problems))


MAX_CAPACITY_FACTOR = 1e6  # places = factor x tokens x k / E, an integer: far beyond "nothing dropped", not inf


def options_problems(experts: int, top_k, capacity_factor, aux_loss_coef) -> list[str]:
    """What makes a MoE layer's routing impossible (config checks and RunConfig.validate share it)."""
    problems = []
    if not isinstance(experts, int) or experts < 1:
        problems.append(f"a MoE layer needs a whole number of experts >= 1, got {experts!r}")
    elif not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        problems.append(f"top_k {top_k!r} (--top-k) must be a whole number from 1 to the {experts} experts: each "
                        f"token goes to k different experts")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (
            int, float)) or not math.isfinite(capacity_factor) or not 0 < capacity_factor <= MAX_CAPACITY_FACTOR):
        problems.append(f"capacity_factor (--capacity-factor) must be a positive number up to {MAX_CAPACITY_FACTOR:g} "
                        f"(1.0: room for an even share, 1.25: Switch's 25% slack; from experts / k on nothing is "
                        f"dropped), or left out for no limit; got {capacity_factor!r}")
    if isinstance(aux_loss_coef, bool) or not isinstance(aux_loss_coef, (int, float)) or not (
            math.isfinite(aux_loss_coef) and 0 <= aux_loss_coef <= MAX_CAPACITY_FACTOR):
        problems.append(f"aux_loss_coef (--aux-loss-coef) must be a number from 0 to {MAX_CAPACITY_FACTOR:g} (Switch "
                        f"uses 0.01; a larger weight drowns the model's own loss), got {aux_loss_coef!r}")
    return problems


def capacity(capacity_factor: float | None, tokens: int, top_k: int, experts: int) -> int | None:
    """Places per expert in a group of `tokens` tokens: ceil(factor x tokens x k / E) (rounded first to
    nine decimals, so that 1.1 x 100 is 110 places, not the 111 of its binary 110.00000000000001)."""
    return None if capacity_factor is None else math.ceil(round(capacity_factor * tokens * top_k / experts, 9))


class MLP(nn.Module):
    """The GELU MLP d -> d_ff -> d: a dense block's (models.Block), and a shared expert's."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Experts(nn.Module):
    """E GELU MLPs (the dense MLP's shape), their weights stacked: expert e is fc_weight[e] ...
    (an expert-parallel rank holds a slice of the rows)."""

    def __init__(self, experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.fc_weight = nn.Parameter(torch.empty(experts, d_model, d_ff).normal_(0.0, 0.02))
        self.fc_bias = nn.Parameter(torch.zeros(experts, d_ff))
        self.proj_weight = nn.Parameter(torch.empty(experts, d_ff, d_model).normal_(0.0, 0.02))
        self.proj_bias = nn.Parameter(torch.zeros(experts, d_model))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens: (sum(counts), d_model), sorted by expert, counts[e] of them for the e-th held."""
        # unbound once (indexing each expert's weight would make its backward a whole (E, ...) tensor per expert);
        # addmm: under autocast the bias joins the product in its dtype, so an expert's output stays bf16
        weights = zip(*(p.unbind(0) for p in (self.fc_weight, self.fc_bias, self.proj_weight, self.proj_bias)))
        return torch.cat([torch.addmm(b2, F.gelu(torch.addmm(b1, x, w1)), w2)
                          for (w1, b1, w2, b2), x in zip(weights, tokens.split(counts))])


class MoE(nn.Module):
    """forward(x: (batch, seq, d_model)) -> same shape; sets `aux_loss` (already times the
    coefficient) and appends [tokens per expert..., dropped] of the batch to `load`."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.experts_total, self.top_k = cfg.experts, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router = nn.Linear(d_model, cfg.experts, bias=False)
        nn.init.normal_(self.router.weight, 0.0, 0.02)
        self.experts = Experts(cfg.experts, d_model, cfg.d_ff or 4 * d_model)
        self.shared = nn.ModuleList(MLP(d_model, cfg.d_ff or 4 * d_model) for _ in range(cfg.shared_experts))
        self.dispatch = None  # None: the experts run here; else dispatch(tokens, counts per expert) -> outputs
        self.reduce_counts = None  # None: this device's batch is the whole batch; else sums counts over ranks
        self.aux_loss = None
        self.load: list[torch.Tensor] = []  # per forward: (E + 1,) tokens per expert (before capacity), dropped
        self.aux: list[torch.Tensor] = []  # per forward: the balancing loss (times its coefficient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        E, k, N = self.experts_total, self.top_k, B * T
        tokens = x.reshape(N, H)
        # the router in fp32 at least, outside autocast (Switch's "selective precision"): in bf16 its scores
        # tie, and which expert a tie goes to would depend on the batch's shape
        wide = torch.promote_types(tokens.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(tokens.to(wide), self.router.weight.to(wide)).softmax(dim=-1)  # (N, E)
        if _EVEN_ROUTING:  # the estimator's fake tensors hold no scores to choose by: an even load, nothing dropped
            chosen = (torch.arange(N * k, device=x.device) % E).view(N, k)
            weight, keep = probs.gather(1, chosen), torch.ones(N * k, dtype=torch.bool, device=x.device)
            per_expert = [len(range(e, N * k, E)) for e in range(E)]
            counts = torch.tensor([*per_expert, 0], device=x.device)
        else:
            weight, chosen = probs.topk(k, dim=-1)  # (N, k)
            keep = self._within_capacity(chosen.view(B, T, k)).reshape(-1)  # (N * k,) in (token, choice) order
            counts = torch.cat([torch.bincount(chosen.view(-1), minlength=E), (~keep).sum().view(1)])
        if k > 1:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        if self.reduce_counts is not None:
            counts = self.reduce_counts(counts)
        share = counts[:E].float() / counts[:E].sum()  # f_i over the whole batch (no gradient: counts)
        self.aux_loss = self.aux_loss_coef * E * (share * probs.mean(dim=0)).sum()
        if torch._C._current_graph_task_id() == -1:  # not activation checkpointing's recompute inside backward
            self.load.append(counts.detach())
            self.aux.append(self.aux_loss.detach())

        # the kept assignments, sorted by expert (stable: in token order within each expert)
        assigned = torch.arange(N * k, device=x.device) if _EVEN_ROUTING else keep.nonzero().view(-1)
        order = assigned[torch.argsort(chosen.view(-1)[assigned], stable=True)]
        token_of = order // k
        if not _EVEN_ROUTING:
            per_expert = torch.bincount(chosen.view(-1)[order], minlength=E)
        sent = tokens[token_of]
        if torch.is_autocast_enabled(x.device.type):  # the rows travel and the experts compute in bf16
            sent = sent.to(torch.get_autocast_dtype(x.device.type))
        if self.dispatch is None:
            y = self.experts(sent, per_expert if _EVEN_ROUTING else per_expert.tolist())
        else:
            y = self.dispatch(sent, per_expert)
        # each output in its (token, choice) place, then the k places summed: the same sum in the same order
        # whatever the batch and the device (index_add's atomics on CUDA would add in any order)
        placed = torch.zeros(N * k, H, dtype=y.dtype, device=x.device)
        placed = placed.index_copy(0, order, y * weight.view(-1)[order].unsqueeze(1).to(y.dtype))
        out = placed.view(N, k, H).sum(dim=1)
        for mlp in self.shared:
            out = out + mlp(tokens).to(out.dtype)
        return out.view(B, T, H).to(x.dtype)

    def _within_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        """(batch, seq, k) bool: whether each assignment finds a place at its expert within its
        sequence; places go first choice first, in token order, then second choices, ..."""
        B, T, k = chosen.shape
        limit = capacity(self.capacity_factor, T, k, self.experts_total)
        if limit is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        claims = F.one_hot(chosen.transpose(1, 2).reshape(B, k * T), self.experts_total)  # choice-major
        place = (claims.cumsum(dim=1) * claims).sum(dim=-1) - 1  # its place in its expert's queue
        return (place < limit).view(B, k, T).transpose(1, 2)


_EVEN_ROUTING = False


@contextmanager
def even_routing():
    """Inside: every MoE layer sends its (token, choice) assignments to the experts in turn, an
    even load with nothing dropped, whatever the router's scores (the estimator traces forward on
    fake tensors, which hold no values to choose by; what it estimates is a balanced layer's)."""
    global _EVEN_ROUTING
    before, _EVEN_ROUTING = _EVEN_ROUTING, True
    try:
        yield
    finally:
        _EVEN_ROUTING = before


def layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the layers' balancing losses from the last forward (times their coefficient)."""
    return sum(layer.aux_loss for layer in layers(model))


OPTIONS = {"moe_top_k": "top_k", "moe_capacity_factor": "capacity_factor",  # RunConfig.extra key -> MoE's
           "moe_aux_loss_coef": "aux_loss_coef"}  # attribute (and, dashed, the run command's flag)


def configure(model: nn.Module, extra: dict) -> None:
    """A run's routing options (RunConfig.extra), over the model's own: they change no shape."""
    for layer in layers(model):
        for key, name in OPTIONS.items():
            setattr(layer, name, extra.get(key, getattr(layer, name)))


# -- reading a report (a record's "moe"): what the chapter and its figures show -----------------

def busiest_by_step(report: dict) -> list[float]:
    """At each forward, the busiest expert's tokens over an even share, the mean over the layers
    (1: balanced; at most E/k)."""
    layers = report["tokens_per_expert"]
    return [sum(max(layer[s]) * len(layer[s]) / sum(layer[s]) for layer in layers) / len(layers)
            for s in range(len(layers[0]))]


def expert_shares(report: dict, layer: int, last: int) -> list[float]:
    """Each expert of `layer`: its tokens over an even share, over the last `last` forwards."""
    loads = report["tokens_per_expert"][layer][-last:]
    total, experts = sum(map(sum, loads)), len(loads[0])
    return [sum(step[e] for step in loads) * experts / total for e in range(experts)]


def dropped_by_step(report: dict) -> list[float]:
    """At each forward, the share of all layers' (token, choice) assignments dropped."""
    dropped, routed = report["dropped"], report["tokens_per_expert"]
    return [sum(layer[s] for layer in dropped) / sum(sum(layer[s]) for layer in routed) for s in range(len(dropped[0]))]


def report(model: nn.Module) -> dict | None:
    """Per layer, per forward: tokens each expert was routed (before capacity), and tokens dropped."""
    moe = layers(model)
    if not moe:
        return None
    return {"tokens_per_expert": [[c[:-1].tolist() for c in layer.load] for layer in moe],
            "dropped": [[int(c[-1]) for c in layer.load] for layer in moe],
            "aux_loss": [[float(a) for a in layer.aux] for layer in moe],  # each layer's term of the loss
            "top_k": moe[0].top_k, "capacity_factor": moe[0].capacity_factor}
