"""The experiments behind the book's figures, by chapter, and what `make figures` runs them with.

- `run`: the registry `EXPERIMENTS` (name -> the list of runs or jobs it makes) and the runner
  that keeps its records whole (`run_experiment`, `run_experiments`);
- `machine`: what the lists are sized by (the GPUs here, `max_world_size`, `tp_degrees`) and `Job`;
- `limits`: the machine's own limits (matmul FLOP/s, memory bandwidth), which MFU is taken against;
  `profiles`: steps under torch's profiler, and one device's MFU by batch;
- one module per chapter: `one_device`, `data_parallel`, `sharding`, `collectives`,
  `model_parallel`, `compositions`;
- the bodies that `run_spmd` starts on every rank, for the experiments and the chapters:
  `tp_bench` (one Megatron MLP by width), `pp_bubble` (sleeping pipeline stages) and
  `step_traces` (what a rank holds and sends in one training step).

The names callers use are here: `from multigpu.experiments import EXPERIMENTS`.
"""

from multigpu.experiments.compositions import COMPOSITIONS
from multigpu.experiments.machine import Job, ddp_device, gpus_here, max_world_size, on_gpus, tp_degrees
from multigpu.experiments.run import EXPERIMENTS, ExperimentFailed, check_results_dir, run_experiment, run_experiments

__all__ = ["COMPOSITIONS", "EXPERIMENTS", "ExperimentFailed", "Job", "check_results_dir", "ddp_device", "gpus_here",
           "max_world_size", "on_gpus", "run_experiment", "run_experiments", "tp_degrees"]
