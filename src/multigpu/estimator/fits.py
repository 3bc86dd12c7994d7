"""Will a run fit in this machine's free memory? The launcher asks before any worker starts
(`memory_problem`): a cheap screen first, the estimator only for a run that fails it.
"""

from __future__ import annotations

import re

from multigpu.errors import ConfigError


def available_bytes(device: str, gpu: int = 0) -> int | None:
    """Memory a worker could still take: the free memory of GPU `gpu`, or the host's
    MemAvailable (Linux's estimate of what can be allocated without swapping); None where
    it cannot be read.

    A GPU's free memory is read from NVML (the driver's management library), not with
    torch.cuda.mem_get_info: that would make a CUDA context on GPU 0 in the calling process
    (a notebook kernel, `multigpu figures`), which holds a few hundred MiB of that GPU for as
    long as the process lives. NVML is the driver's own library (libnvidia-ml.so.1, read as
    torch itself reads it for device counts); where it does not answer, the screen is skipped:
    a run too large for the GPU then stops at its first step with CUDA's out-of-memory error."""
    if device == "cuda":
        return _nvml_free_bytes(gpu)
    try:
        with open("/proc/meminfo") as f:
            found = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _nvml_free_bytes(index: int) -> int | None:
    """Free memory of CUDA device `index` (as CUDA_VISIBLE_DEVICES numbers it) from NVML through
    ctypes, or None where NVML does not answer."""
    from ctypes import CDLL, Structure, byref, c_uint, c_ulonglong, c_void_p

    class Memory(Structure):  # nvmlMemory_t
        _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]

    try:
        import torch

        nvml = CDLL("libnvidia-ml.so.1")
        handle, memory = c_void_p(), Memory()
        if (nvml.nvmlInit_v2() != 0
                or nvml.nvmlDeviceGetHandleByIndex_v2(c_uint(torch.cuda._get_nvml_device_index(index)),
                                                      byref(handle)) != 0
                or nvml.nvmlDeviceGetMemoryInfo(handle, byref(memory)) != 0):
            return None
        return int(memory.free)
    except Exception:  # no driver library, a symbol or an index NVML does not know: no screen
        return None


def memory_problem(cfg, device: str, per_node: int, gpu: int = 0) -> str | None:
    """Why this run cannot fit in this machine's memory, in the estimator's numbers, or None.

    A cheap screen first, so that small runs pay nothing: the model states of a whole
    unsharded AdamW copy (20 bytes per parameter) and 16 KiB per token in flight, times the
    processes here, against a fifth of the free memory. Only a run that fails the screen is
    estimated (chapter "Choosing a strategy": within about 10% of measured peaks). Strategies
    and models the estimator does not model pass."""
    from multigpu.models import parameter_count

    free = available_bytes(device, gpu)
    if free is None:
        return None
    on_one = per_node if device == "cpu" else 1  # CPU processes share the host; each GPU is its own
    tokens = cfg.micro_batch_size * (cfg.seq_len or 1024)
    if (20 * parameter_count(cfg.model) + 16 * 2**10 * tokens) * on_one < free / 5:
        return None
    import torch

    from multigpu.estimator import peak as est
    from multigpu.estimator.accuracy import setup_of
    from multigpu.records import cpu_name

    name = torch.cuda.get_device_name(gpu) if device == "cuda" else cpu_name()
    setup = setup_of({"config": cfg.to_dict(), "provenance": {
        "backend": "nccl" if device == "cuda" else "gloo", "device_type": device, "device_names": [name]}})
    if setup is None:
        return None
    try:
        need = est.estimate(setup, cfg.global_batch_size).per_rank_bytes["total"]
    except ConfigError:
        return None  # what the estimator cannot answer, the run itself will find out
    if need * on_one <= free:
        return None
    fits = est.predict_largest_batch(setup, free // on_one)
    where = f"{on_one} processes on this machine need {need * on_one / 2**30:.1f} GiB" if on_one > 1 else \
        "the GPU needs that"
    return (f"this run needs about {need / 2**30:.1f} GiB per process (estimated: model states, activations, "
            f"buffers at the step's peak); {where}, and {free / 2**30:.1f} GiB is free; "
            + (f"try --global-batch-size {fits.global_batch} (the largest that fits, estimated), " if fits else "")
            + "a sharded strategy (zero3, fsdp), activation checkpointing, or fewer processes; or pass "
            "check_memory=False (--no-memory-check) to start it anyway")
