"""A fake CUDA for the processes a GPU-shaped test starts (notebook kernels), read from the
environment:

    MULTIGPU_FAKE_CUDA="8:NVIDIA H100 80GB HBM3"   # count:name, a name in GPUS below
    MULTIGPU_FAKE_CPUS=32                         # optional: what os.cpu_count() says

With this folder on PYTHONPATH, Python imports this module as it starts (the `site`
module's sitecustomize hook), and with MULTIGPU_FAKE_CUDA set, torch.cuda then claims that
many such GPUs as far as the package and the chapters ask: is_available, device_count, the
name, properties and compute capability, free memory, cuBLAS's workspace size, the CUDA and
NCCL versions, a +cu128 torch. `records.machine_tag()`, `records.executed_here()`,
`experiments.gpus_here()` and a chapter's own `torch.cuda.device_count()` answer for the fake
server. Nothing can run on these GPUs: a tensor moved to "cuda" still fails (so does
`nn.DataParallel` of a model on a one-GPU fake, which moves it there; with two or more it
only reads the properties).

tests/gpu_shaped.py fakes the pytest process with the same table (`patches`). Without
MULTIGPU_FAKE_CUDA this module does nothing (and imports nothing but os)."""

from __future__ import annotations

import os
from types import SimpleNamespace

ENV, CPUS_ENV = "MULTIGPU_FAKE_CUDA", "MULTIGPU_FAKE_CPUS"

# name -> (total_memory as torch.cuda.get_device_properties reports it, compute capability,
# streaming multiprocessors); the memory is plausible for the card, not read from one
GPUS = {
    "NVIDIA H100 80GB HBM3": (85_029_158_912, (9, 0), 132),
    "NVIDIA A100-SXM4-80GB": (85_097_971_712, (8, 0), 108),
    "Tesla V100-SXM2-32GB": (34_089_730_048, (7, 0), 80),
}
CUDA_CONTEXT_BYTES = 536_870_912  # what the CUDA context takes of a GPU before any tensor (about 500 MiB)


def cublas_workspace_size(capability: tuple[int, int]) -> int:
    """One cuBLAS workspace as torch 2.13 sizes it by default (CublasHandlePool.cpp,
    getChosenWorkspaceSize): 4096 KiB x 8 on Hopper and later, 4096 KiB x 2 + 16 KiB x 8 before."""
    major, minor = capability
    return 4096 * 1024 * 8 if major in (9, 10, 12) or (major, minor) == (11, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def patches(gpus: int, name: str) -> list[tuple[object, str, object]]:
    """(object, attribute, fake) for every part of torch that says what CUDA GPUs there are."""
    import torch
    import torch.cuda.nccl

    if name not in GPUS:
        raise ValueError(f"{ENV}: no fake for a GPU named {name!r}; known: {', '.join(GPUS)}")
    total, capability, processors = GPUS[name]
    properties = SimpleNamespace(name=name, total_memory=total, major=capability[0], minor=capability[1],
                                 multi_processor_count=processors)
    version = torch.__version__.split("+")[0] + "+cu128"
    return [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: gpus),
        (torch.cuda, "get_device_name", lambda device=None: name),
        (torch.cuda, "get_device_properties", lambda device=None: properties),
        (torch.cuda, "get_device_capability", lambda device=None: capability),
        (torch.cuda, "mem_get_info", lambda device=None: (total - CUDA_CONTEXT_BYTES, total)),
        (torch.cuda.nccl, "version", lambda: (2, 27, 5)),
        (torch.backends.cuda, "cublas_workspace_size", lambda size=None: cublas_workspace_size(capability)),
        (torch.version, "cuda", "12.8"),
        (torch, "__version__", torch.torch_version.TorchVersion(version)),
    ]


def parse(value: str) -> tuple[int, str]:
    """'8:NVIDIA H100 80GB HBM3' -> (8, 'NVIDIA H100 80GB HBM3')."""
    count, _, name = value.partition(":")
    if not count.strip().isdigit() or int(count) < 1 or not name.strip():
        raise ValueError(f"{ENV}={value!r}: expected COUNT:NAME, e.g. '8:NVIDIA H100 80GB HBM3'")
    return int(count), name.strip()


def install(environ) -> None:
    """Apply the fake that `environ` asks for, if any."""
    if environ.get(ENV):
        for obj, attribute, fake in patches(*parse(environ[ENV])):
            setattr(obj, attribute, fake)
    if environ.get(CPUS_ENV):
        cpus = int(environ[CPUS_ENV])
        os.cpu_count = lambda: cpus


install(os.environ)
