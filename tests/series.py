"""Records of launched runs, shared by a test module and started as series.

A test module that reads several small runs asks `RunCache(planned)` for each: the first
request of a config runs it together with every other planned config of the same number of
processes in one torchrun (launch.launch_series: one set of processes and one process group,
each run with its own model, seed and record), instead of one torchrun each, which costs more
than the run itself. A config that was not planned, or whose series failed before reaching
it, is launched on its own, so that its failure is its own test's."""

from __future__ import annotations

from collections.abc import Callable

from multigpu.config import RunConfig
from multigpu.launch import LaunchError, launch, launch_series


class RunCache:
    def __init__(self, planned: Callable[[], list[RunConfig]]):
        self.planned = planned  # called on the first request: the module's configs, its globals all defined
        self.records: dict[str, dict] = {}

    def __call__(self, cfg: RunConfig) -> dict:
        key = cfg.to_json()
        if key not in self.records:
            todo = {c.to_json(): c for c in [cfg, *self.planned()] if c.processes == cfg.processes}
            todo = [c for k, c in todo.items() if k not in self.records]
            try:
                done = launch_series(todo)
            except LaunchError as err:
                done = err.records
            self.records.update((c.to_json(), r) for c, r in zip(todo, done))
            if key not in self.records:
                self.records[key] = launch(cfg, progress=False)  # not planned, or its series stopped first
        return self.records[key]
