"""What the sources measured, in one place with the setting they measured it in, so that the
chapters set the book's own answers beside them (their numbers are never typed into prose).

The sources are the tutorials this book grew from (the chapter "Choosing a strategy" names
what each measured); their numbers are quoted, not re-measured here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LargestBatch:
    """One row of the sources' T5 table: the largest global batch that trained."""

    model: str
    strategy: str  # the estimator's name for what the source ran
    gpus: int
    batch: int  # the global batch; 0: not even one sample
    says: str  # "largest": the largest that fitted; "fits": a batch that fitted, no larger one tried


# T5 as released (pretrained checkpoints: dropout 0.1; the attention transformers ran in 2022,
# eager), fp32, SGD with momentum (lr 0.01, momentum 0.9), random token ids 256 in and 256 out,
# V100s (32 GB: inferred, the sources say V100 only; their batches fit only the 32 GB card),
# torch 1.12; FSDP auto-wraps every T5Block
T5_SETTING = dict(seq_len=256, target_len=256, dtype="fp32", optimizer="sgd-momentum", attention="eager",
                  dropout=True)
T5_GPU = "v100-32gb"
T5_TORCH = "1.12"
T5_LARGEST_BATCH = (
    LargestBatch("t5-large", "single", 1, 14, "largest"),
    LargestBatch("t5-large", "dp", 4, 36, "largest"),
    LargestBatch("t5-large", "ddp", 4, 48, "largest"),
    LargestBatch("t5-large", "fsdp", 4, 64, "largest"),
    LargestBatch("t5-3b", "dp", 4, 0, "largest"),
    LargestBatch("t5-3b", "ddp", 4, 0, "largest"),
    LargestBatch("t5-3b", "fsdp", 4, 8, "fits"),
)

# what the book calls agreeing with a source's number: within 15% of it
AGREES = 0.15

# one epoch of a ResNet image classifier with DDP, 128 samples per process: GPUs -> seconds
RESNET_DDP_EPOCH_S = {1: 128.84, 2: 66.5, 4: 37.8}

# the machine of the best-strategy chart the sources cite (by model size and batch): a name of
# multigpu.estimator.machines.MACHINES
STRATEGY_CHART_MACHINE = "8xa100-nvlink"
