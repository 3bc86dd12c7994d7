"""The loss every model of the package trains on, in a module of its own so that the models,
the Hugging Face builder and the pipelines share it without importing one another."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every label token (in fp32, whatever the logits' dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
