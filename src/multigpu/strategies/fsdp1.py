"""FSDP1: the `FullyShardedDataParallel` wrapper, as the sources use it.

`transformer_auto_wrap_policy` wraps every transformer block (T5Block for T5) in its own
FSDP unit and the rest in the root unit; each unit flattens its parameters into one
FlatParameter and shards it. On a CPU, FSDP1 needs `device_id=torch.device("cpu")`.
"""

import functools

import torch
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from multigpu.models import transformer_block_types
from multigpu.strategies import Parallelized, build_optimizer


def prepare(model, cfg, rt) -> Parallelized:
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(transformer_block_types(model)))
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
          if cfg.dtype == "bf16-mixed" else None)
    fsdp_model = FSDP(model, auto_wrap_policy=policy, device_id=rt.device, mixed_precision=mp)
    optimizer = build_optimizer(fsdp_model.parameters(), cfg)

    def gather_state_dict():
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(fsdp_model, StateDictType.FULL_STATE_DICT, config):
            return fsdp_model.state_dict()

    return Parallelized(module=fsdp_model, optimizer=optimizer, model=model, no_sync=fsdp_model.no_sync,
                        gather_state_dict=gather_state_dict)
