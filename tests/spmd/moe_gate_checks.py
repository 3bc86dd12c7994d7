"""DeepSpeed-MoE's gate as strategies/deepspeed_moe.py hands it its router, under bf16 autocast
(bf16-mixed's forward) and without: `gate_under_autocast` runs in a process group of one via
`run_spmd("spmd.moe_gate_checks:gate_under_autocast", 1)` (tests/test_moe.py), so that DeepSpeed is
imported in a worker, not in the test's own process."""

from __future__ import annotations

import torch

from multigpu import moe
from multigpu.models import build_model


def gate_under_autocast(tokens: int = 128) -> dict:
    """The largest difference between the gate's outputs (scores, choices, counts) in fp32 and under
    bf16 autocast, for the package's gate and for DeepSpeed's own forward (the router's product in
    bf16), on one layer of gpt-moe-tiny."""
    from multigpu.strategies.deepspeed import import_deepspeed
    from multigpu.strategies.deepspeed_moe import LibraryMoE

    deepspeed = import_deepspeed("cpu")
    ours = next(m for m in build_model("gpt-moe-tiny").modules() if isinstance(m, moe.MoE))
    gate = LibraryMoE(ours, 1, 0, deepspeed).library.deepspeed_moe.gate
    torch.manual_seed(1)
    x = torch.randn(tokens, ours.router.weight.shape[1])
    library = type(gate).forward  # DeepSpeed's forward, without the package's autocast-free region

    def gap(forward) -> float:
        plain = forward(x, None, True, False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = forward(x, None, True, False)
        return max(float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())
                   for a, b in zip(plain, under))

    return {"package": gap(gate), "library": gap(lambda *a: library(gate, *a))}
