"""Synchronous against asynchronous updates: what stale gradients cost.

With synchronous data parallelism every step waits for all workers' gradients of the
current weights. An asynchronous parameter server (Dean et al., "Large Scale Distributed
Deep Networks", 2012) applies each worker's gradient as soon as it arrives; by then the
other workers have moved the weights on, so the gradient was computed on weights `delay`
updates old. This module replays exactly that on one process: at step t it applies the
gradient taken at the weights of step t - delay, and records the loss of the current
weights. delay=0 is ordinary synchronous SGD.
"""

from __future__ import annotations

import copy
import time
from collections import deque

import torch

from multigpu.data import TokenDataset
from multigpu.models import build_model, compute_loss, default_seq_len, vocab_size


def train_with_stale_gradients(delay: int, *, model: str = "gpt-tiny", steps: int = 150, batch_size: int = 16,
                               lr: float = 0.3, seed: int = 0) -> dict:
    """SGD where the gradient applied at step t is that of the weights at step t - delay."""
    if not isinstance(delay, int) or delay < 0:
        raise ValueError(f"delay must be a whole number of updates >= 0, got {delay!r}")
    torch.manual_seed(seed)
    current = build_model(model, seed)
    stale = copy.deepcopy(current)  # where the delayed gradient is computed
    seq_len = default_seq_len(model)
    data = TokenDataset(model, "synthetic", steps * batch_size, seq_len, vocab_size(model), seed)
    history = deque([copy.deepcopy(current.state_dict())], maxlen=delay + 1)  # weights of the last delay+1 steps
    optimizer = torch.optim.SGD(current.parameters(), lr=lr)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        batch = {k: v[step * batch_size:(step + 1) * batch_size] for k, v in data.tensors.items()}
        with torch.no_grad():
            losses.append(compute_loss(current, batch).item())  # the weights the server holds now
        stale.load_state_dict(history[0])  # the oldest kept: `delay` updates ago
        stale.zero_grad(set_to_none=True)
        compute_loss(stale, batch).backward()
        for p, g in zip(current.parameters(), stale.parameters()):
            p.grad = g.grad
        optimizer.step()
        history.append(copy.deepcopy(current.state_dict()))
    return {"delay": delay, "model": model, "steps": steps, "global_batch_size": batch_size, "lr": lr,
            "seed": seed, "loss": losses, "wall_time_s": time.perf_counter() - start}
