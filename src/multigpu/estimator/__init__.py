"""The estimator: memory per rank and time per step, before anything runs, and the advice
built on them.

- `question`: the question (`Setup`: a model, a strategy, a grid of ranks, a batch), its
  checks, and what a GPU holds besides the step's tensors;
- `model_trace`: what a model is and what its forward keeps, counted on the meta device and
  traced on fake tensors;
- `share`: what one rank holds of the model under tensor and pipeline parallelism;
- `peak`: a step's peak per rank, phase by phase (`estimate`), and the largest batch that fits;
- `machines` and `step_time`: machines as numbers, and a step's time on them;
- `formulas`: the closed forms the chapters reason with (a bubble, a strategy's payloads);
- `advise`: which strategy, by the sources' guide and by these numbers;
- `accuracy`: the estimates beside the records, and the machine's own peak calibrated on them;
- `fits`: whether a run about to launch fits in this machine's free memory;
- `cli`: the `estimate` and `advise` commands;
- `calculator`: the estimator's answers precomputed for the static site.

The question's and the peak's main names are here (`from multigpu.estimator import Setup,
estimate`), imported when first asked for, so that a caller of one submodule does not import
the others.
"""

from importlib import import_module

# name -> the submodule that defines it
_NAMES = {
    **dict.fromkeys(("Setup", "GPUS", "DEFAULT_CUDA_CONTEXT", "ESTIMATOR_DTYPES", "PIPELINES",
                     "cublas_workspace_bytes", "allocator_rounding_bytes", "on_gpu"), "question"),
    **dict.fromkeys(("ModelShape", "ActivationCost", "GPTParts", "model_shape", "activation_cost", "gpt_parts"),
                    "model_trace"),
    **dict.fromkeys(("RankShare", "rank_shares"), "share"),
    **dict.fromkeys(("Estimate", "estimate", "model_states", "optimizer_step_temporary", "saved_activations",
                     "predict_largest_batch", "per_gpu"), "peak"),
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])
