"""SPMD checks of the library's tensor parallelism (multigpu.strategies.tp and tp_plan), for
tests/test_tp_library.py.

    run_spmd("spmd.tp_library_checks:parity", 2, cases=[{"sequence_parallel": True}])

Every rank builds the single-device model from the same seed and trains it one step on
the whole batch: the reference. Then it builds the model again, makes it tensor-parallel
through the strategy's own `prepare`, and runs the same step. Every rank feeds the same
batch (tensor-parallel ranks share their data). We report the largest differences of the
loss, of every gradient (DTensors gathered whole) and of every updated parameter.
"""

from __future__ import annotations

import copy
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from multigpu.comm import CommCounter
from multigpu.models import build_model, compute_loss
from multigpu.strategies.state import fused_state_dict


def _build(model_name: str, seed: int):
    if model_name.startswith("tiny-llama"):  # "tiny-llama", or "tiny-llama-tied": head = embedding
        import json

        from multigpu.hf import build_causal_lm, write_tiny_llama_config

        with tempfile.TemporaryDirectory() as tmp:
            path = write_tiny_llama_config(tmp)
            if model_name.endswith("-tied"):
                path.write_text(json.dumps({**json.loads(path.read_text()), "tie_word_embeddings": True}))
            return build_causal_lm(path, seed)
    return build_model(model_name, seed)


def _loss(model, batch):
    if hasattr(model, "config") and hasattr(model, "lm_head"):
        from multigpu.hf import hf_loss

        return hf_loss(model, batch)
    return compute_loss(model, batch)


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _plain(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def parity(model: str = "gpt-tiny", cases: list[dict] | None = None, batch: int = 4, seq_len: int = 16,
           lr: float = 0.1, optimizer: str = "sgd", seed: int = 0, dp: int = 1) -> list[dict]:
    """For each case ({"sequence_parallel", "loss_parallel", "activation_checkpointing"}):
    {case, loss, max_loss_diff, max_grad_diff, max_param_diff, worst_param, param_names, dtensor_params,
    loss_is_plain_tensor, local_hidden_shape, comm_calls, comm_payload_bytes, tied}."""
    from multigpu.runtime import RankGrid
    from multigpu.strategies import build_optimizer
    from multigpu.strategies.tp import prepare

    world = dist.get_world_size()
    rt = SimpleNamespace(grid=RankGrid.build("cpu", dp=dp, tp=world // dp), device=torch.device("cpu"),
                         world_size=world, rank=dist.get_rank())
    base = _build(model, seed)
    vocab = base.config.vocab_size if hasattr(base, "config") else base.cfg.vocab_size
    g = torch.Generator().manual_seed(seed + 1)  # the same batch on every rank
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    data = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    results = []
    for case in cases or [{}]:
        cfg = SimpleNamespace(optimizer=optimizer, lr=lr, extra={k: v for k, v in case.items()
                                                                 if k != "activation_checkpointing"},
                              activation_checkpointing=bool(case.get("activation_checkpointing")))
        ref = copy.deepcopy(base)
        ref_opt = build_optimizer(ref.parameters(), cfg)
        ref_loss = _loss(ref, data)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_state = ref.state_dict()

        ours = copy.deepcopy(base)
        par = prepare(ours, cfg, rt)  # tensor parallel, then checkpointing if the case asks
        seen = []  # the residual stream as this rank holds it, entering the first block
        first = ours.model.layers[0] if hasattr(ours, "config") else ours.blocks["0"]
        hook = first.register_forward_pre_hook(lambda m, args, kwargs, seen=seen: seen.append(
            tuple((args[0] if args else kwargs["hidden_states"]).shape)), with_kwargs=True)
        par.zero_grad()
        with CommCounter(world) as comm:  # the collectives of one forward and backward
            loss = par.module(**data)
            hook.remove()
            par.backward(loss)
        # the fused attention projection went through QKV: its gradient comes back fused
        grads = fused_state_dict({_plain(n): _whole(p.grad) for n, p in ours.named_parameters()})
        par.step()
        state = par.full_state_dict()
        if state.keys() != ref_state.keys():
            raise AssertionError(f"state_dict names differ: {sorted(set(state) ^ set(ref_state))}")
        param_diffs = {k: (state[k] - v).abs().max().item() for k, v in ref_state.items()}
        results.append({
            "case": case,
            "loss": loss.item(),
            "max_loss_diff": abs(loss.item() - ref_loss.item()),
            "max_grad_diff": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
            "max_param_diff": max(param_diffs.values()),
            "worst_param": max(param_diffs, key=param_diffs.get),
            "param_names": sorted(state),
            "dtensor_params": sorted(_plain(n) for n, p in ours.named_parameters() if isinstance(p, DTensor)),
            "loss_is_plain_tensor": type(loss) is torch.Tensor,
            "local_hidden_shape": seen[0],
            "comm_calls": dict(comm.calls),
            "comm_payload_bytes": dict(comm.payload_bytes),
            "tied": ours.lm_head.weight is (ours.get_input_embeddings() if hasattr(ours, "config")
                                            else ours.wte).weight,
        })
    return results


def seq_len_error(seq_len: int = 15) -> str:
    """Sequence parallelism on a sequence the ranks cannot share evenly: the message."""
    from torch.distributed.device_mesh import init_device_mesh

    from multigpu.strategies.tp_plan import parallelize_gpt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_gpt(build_model("gpt-tiny"), mesh, sequence_parallel=True)
    ids = torch.zeros(2, seq_len, dtype=torch.long)
    try:
        model(input_ids=ids, labels=ids)
    except ValueError as err:
        return str(err)
    return "no error"


def several(calls: list[tuple[str, dict]]) -> list:
    """Run several of this module's checks in one launch (a launch costs seconds)."""
    return [globals()[name](**kwargs) for name, kwargs in calls]
