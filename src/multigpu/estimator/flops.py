"""The FLOPs of a training step, counted from the model's own modules, and the share of the
machine's limit a run reached: MFU and HFU.

Per sample, forward, `sample_flops` counts
- the weights: 2 FLOPs per weight a token is multiplied by (every `nn.Linear`, the head among
  them; not an embedding's lookup; a mixture of experts: k of its E experts);
- the attention: its two products, queries x keys and scores x values, 2 x q_len x k_len x the
  queries' width each, whole: a causal mask does not halve them (the Ultra-Scale Playbook's
  12 L h s per token, as picotron's and torchtitan's MFU count it, and as
  `torch.utils.flop_counter` counts the products).

Backward costs twice the forward (the inputs' gradients and the weights'), so a step's *model*
FLOPs are 3 x forward. The *hardware* FLOPs add what the machine ran again: activation
checkpointing recomputes each block's forward (not the embeddings' nor the head's), all of it but
the block's last product: torch's checkpoint stops recomputing once the last tensor backward
needs is back, and the MLP's output projection feeds only the residual sum, which saves nothing
(a mixture of experts saves its experts' outputs to weigh them by the router's scores: it runs
whole again). Selective recomputation (`multigpu.recompute`) runs again only each block's output
projections (attention's, the MLP's), but its last product, again by the early stop.

MFU = model FLOPs of a step / (seconds x the peak FLOP/s of the devices that ran it); HFU the
same with hardware FLOPs. A step's FLOPs are the whole global batch's (every micro-batch of an
accumulation, every data-parallel rank): they go with the peak of every rank, never with
one's (`utilization`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from torch import nn

from multigpu.errors import ConfigError
from multigpu.recompute import is_output_projection, recompute_mode


@dataclass(frozen=True)
class SampleFlops:
    """Forward FLOPs of one sample: its weights' products, its attention's, and what of the two
    activation checkpointing runs again (the blocks', but for each one's last product)."""

    weights: float
    attention: float
    in_blocks: float
    routed: float = 0.0  # of the weights', a mixture of experts' routed experts' (k of E per token)
    projections: float = 0.0  # of the blocks', the output projections selective recomputation runs again

    @property
    def forward(self) -> float:
        return self.weights + self.attention

    @property
    def model(self) -> float:
        """Forward and backward (twice the forward): what the model needs, however it is run."""
        return 3 * self.forward

    def dropping(self, share: float) -> SampleFlops:
        """The same sample with `share` of its routed experts' products never run (assignments over a capacity)."""
        cut = self.routed * share
        return SampleFlops(self.weights - cut, self.attention, self.in_blocks - cut, self.routed - cut,
                           self.projections)

    def hardware(self, activation_checkpointing: bool | str) -> float:
        """What the machine computes: the model's FLOPs, plus what recomputation runs again: the blocks'
        forward (full), their output projections (selective)."""
        mode = recompute_mode(activation_checkpointing)
        return self.model + {"full": self.in_blocks, "selective": self.projections}.get(mode, 0.0)


@dataclass(frozen=True)
class _Structure:
    """A model's products, per token of the stream they see: weights seen by source tokens (a decoder's only
    stream) and by target tokens (T5's decoder), those of them checkpointing runs again, and the blocks'
    attentions as (queries' width, query stream, key stream)."""

    source_weights: float
    target_weights: float
    source_in_blocks: float
    target_in_blocks: float
    attentions: tuple[tuple[int, str, str], ...]
    routed: float = 0.0  # of the source weights, the routed experts' (decoders only)
    projections: tuple[float, float] = (0.0, 0.0)  # (source, target) weights selective recomputation runs again


def _query_width(module: nn.Module) -> int | None:
    """The width of an attention module's queries (heads x head size), None for any other module."""
    from multigpu.models import CausalSelfAttention

    if isinstance(module, CausalSelfAttention):
        return module.qkv.out_features // 3
    kind = type(module).__name__
    if kind == "T5Attention":
        return module.inner_dim
    if kind.endswith("Attention") and isinstance(getattr(module, "q_proj", None), nn.Linear):
        return module.q_proj.out_features  # Llama and its kin: grouped keys and values leave the scores whole
    return None


def _streams(name: str, t5: bool) -> tuple[str, str]:
    """(queries' stream, keys' stream) of the module called `name`: T5's encoder and its decoder's cross-attention
    keys and values see the source, the rest of its decoder the target; a decoder-only model, the source."""
    if not t5 or name.startswith("encoder."):
        return "source", "source"
    return "target", ("source" if ".EncDecAttention" in name else "target")


@lru_cache(maxsize=32)
def _structure(model: str) -> _Structure:
    from multigpu.estimator.model_trace import meta_model
    from multigpu.models import transformer_blocks
    from multigpu.moe import MoE

    built, family = meta_model(model)
    t5 = family == "t5"
    in_blocks = {id(m) for block in transformer_blocks(built) for m in block.modules()}
    weights = {"source": 0.0, "target": 0.0}
    blocks = {"source": 0.0, "target": 0.0}
    attentions, seen, routed = [], set(), 0.0
    for name, module in built.named_modules(remove_duplicate=False):
        width = _query_width(module)
        queries, keys = _streams(name, t5)
        if width is not None:
            attentions.append((width, queries, keys, id(module) in in_blocks))
        products = []
        if isinstance(module, nn.Linear):
            stream = keys if re.search(r"EncDecAttention\.[kv]$", name) else queries
            products = [(module.weight, stream, 1.0)]
        elif isinstance(module, MoE):  # each token runs k of the E experts
            share = module.top_k / module.experts_total
            products = [(module.experts.fc_weight, queries, share), (module.experts.proj_weight, queries, share)]
        for weight, stream, share in products:
            if id(weight) in seen:
                continue  # a weight used by two modules (a tied head) is one product per token
            seen.add(id(weight))
            weights[stream] += weight.numel() * share
            routed += weight.numel() * share if isinstance(module, MoE) else 0.0
            if id(module) in in_blocks:
                blocks[stream] += weight.numel() * share
    names = {id(m): n for n, m in built.named_modules()}
    projections = {"source": 0.0, "target": 0.0}
    for block in transformer_blocks(built):  # checkpointing's early stop: the block's last product is not run again
        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        last = None if any(isinstance(m, MoE) for m in block.modules()) else linears[-1]  # (an MoE's outputs are
        if last is not None:  # saved: all of it runs)
            blocks[_streams(names[id(last)], t5)[0]] -= last.weight.numel()
        for m in linears:
            if m is not last and is_output_projection(names[id(m)], m):
                projections[_streams(names[id(m)], t5)[0]] += m.weight.numel()
    return _Structure(weights["source"], weights["target"], blocks["source"], blocks["target"],
                      tuple((w, q, k) for w, q, k, inside in attentions if inside), routed,
                      (projections["source"], projections["target"]))


def sample_flops(model: str, seq_len: int, target_len: int | None = None) -> SampleFlops:
    """Forward FLOPs of one sample of `model` (a preset or a config.json) at `seq_len` tokens (T5: `seq_len`
    source and `target_len` target tokens, default the same); "params:<count>" models: 2 per parameter per
    token, no attention known."""
    found = re.fullmatch(r"params:(.+)", model)
    if found:
        from multigpu.estimator.model_trace import model_shape

        n = model_shape(model).parameters * 2.0 * seq_len
        return SampleFlops(n, 0.0, n)
    if seq_len <= 0:
        raise ConfigError(f"a sequence of {seq_len} tokens has no FLOPs: give a positive length")
    s = _structure(model)
    tokens = {"source": seq_len, "target": target_len or seq_len}
    weights = 2.0 * (s.source_weights * tokens["source"] + s.target_weights * tokens["target"])
    in_blocks = 2.0 * (s.source_in_blocks * tokens["source"] + s.target_in_blocks * tokens["target"])
    attention = sum(4.0 * width * tokens[q] * tokens[k] for width, q, k in s.attentions)
    projections = 2.0 * (s.projections[0] * tokens["source"] + s.projections[1] * tokens["target"])
    return SampleFlops(weights, attention, in_blocks + attention, 2.0 * s.routed * tokens["source"], projections)


def step_flops(config: dict, seq_len: int | None = None, dropped: float = 0.0) -> tuple[float, float]:
    """(model, hardware) FLOPs of one training step of a run's config (its `RunConfig.to_dict()`; `seq_len` the
    run's, where the config left it to the model): the whole global batch, every micro-batch and every rank's;
    `dropped`: the share of a mixture of experts' assignments its capacity dropped. T5's target is as long as
    its source (multigpu.data)."""
    per_sample = sample_flops(config["model"], seq_len or config["seq_len"]).dropping(dropped)
    batch = config["global_batch_size"]
    return per_sample.model * batch, per_sample.hardware(config.get("activation_checkpointing", False)) * batch


# a run's dtype -> the products it runs: fp32 is fp32 (the package never turns TF32 on)
RUN_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def peak_flops_per_s(limits: list[dict], dtype: str, threads: int | None = None) -> float | None:
    """The achievable matmul FLOP/s of `dtype` in experiment machine_limits' records `limits` (the best call of
    the best size); on a CPU at `threads` threads: between two measured counts on the line between them, past the
    most (the cores) that count's, as threads beyond the cores share them. None where none was measured."""
    best: dict = {}
    for r in limits:
        if r["kind"] == "matmul" and r["dtype"] == dtype:
            best[r["threads"]] = max(best.get(r["threads"], 0.0), r["best_flops_per_s"])
    if not best:
        return None
    if threads is None or None in best:
        return max(best.values())
    counts = sorted(best)
    if threads <= counts[0]:
        return best[counts[0]] * threads / counts[0]
    if threads >= counts[-1]:
        return best[counts[-1]]
    low, high = max(c for c in counts if c <= threads), min(c for c in counts if c >= threads)
    return best[low] if low == high else best[low] + (best[high] - best[low]) * (threads - low) / (high - low)


def utilization(record: dict, limits: list[dict] | None = None) -> dict | None:
    """MFU and HFU of a training run's record against its machine's measured matmul peak (experiment
    machine_limits of the record's machine, or `limits`): {"mfu", "hfu", "model_flops_per_step",
    "hardware_flops_per_step", "peak_flops_per_s": every device of the run together, "devices"}. The peak is the
    run's dtype's, times its GPUs; on a CPU, at the threads its processes (or DataParallel's replicas) ran, never
    more than the cores. A mixture of experts that dropped assignments over its capacity is not counted the
    products it skipped. None for a record with no step time, or whose machine has no measured peak of its
    dtype."""
    if not record.get("step_time_s") or "config" not in record:
        return None
    config, prov = record["config"], record["provenance"]
    if limits is None:
        from multigpu import records

        path = records.results_path("machine_limits", prov["machine_tag"])
        limits = records.read_records(path) if path.exists() else []
    dtype = RUN_DTYPE[config["dtype"]]
    if prov["device_type"] == "cuda":
        devices = config["world_size"]
        per_device = peak_flops_per_s(limits, dtype)
        peak = per_device * devices if per_device else None
    else:  # every process (or DataParallel's replica, a thread) with its threads, on the cores there are
        devices = min(prov["cpu_count"], config["world_size"] * prov["threads_per_worker"])
        peak = peak_flops_per_s(limits, dtype, devices)
    if not peak:
        return None
    dropped = 0.0
    if record.get("moe"):  # a capacity dropped some (token, expert) assignments: their products never ran
        from multigpu.moe import dropped_by_step

        by_step = dropped_by_step(record["moe"])
        dropped = sum(by_step) / len(by_step)
    model, hardware = step_flops(config, record.get("seq_len"), dropped)
    seconds = record["step_time_s"]
    return {"mfu": model / seconds / peak, "hfu": hardware / seconds / peak, "model_flops_per_step": model,
            "hardware_flops_per_step": hardware, "peak_flops_per_s": peak, "devices": devices}
