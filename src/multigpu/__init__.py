"""multigpu: train one model on many devices, the package behind the book.

    from multigpu import RunConfig, launch, check
    record = launch(RunConfig(strategy="ddp", world_size=2))
"""

from multigpu.check import check
from multigpu.config import ConfigError, RunConfig
from multigpu.launch import LaunchError, launch  # the function `launch` hides the module's name here

__all__ = ["RunConfig", "ConfigError", "launch", "check", "LaunchError"]
__version__ = "0.1.0"
