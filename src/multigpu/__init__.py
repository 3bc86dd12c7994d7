"""multigpu: train one model on many devices, the package behind the book.

    from multigpu import RunConfig, launch, check
    record = launch(RunConfig(strategy="ddp", world_size=2))
"""

from multigpu.config import ConfigError, RunConfig

__all__ = ["RunConfig", "ConfigError", "launch", "check", "LaunchError"]
__version__ = "0.1.0"


def __getattr__(name):  # import torch-heavy parts only when used
    if name in ("launch", "LaunchError"):
        from multigpu import launch as _launch

        return getattr(_launch, name)
    if name == "check":
        from multigpu.check import check

        return check
    raise AttributeError(name)
