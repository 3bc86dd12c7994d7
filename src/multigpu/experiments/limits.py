"""This machine's limits, measured, which MFU is taken against (`multigpu.estimator.flops.utilization`):

- the matrix multiply's achievable FLOP/s, by dtype, size and CPU threads: square products swept
  from small to large, the best of each size's calls kept, in the spirit of the ML Engineering
  book's MAMF finder (a datasheet's peak is a promise; this is what a product reaches here);
- the memory's bandwidth: a large tensor copied, bytes read and written per second.

The link's limit is experiment link_model's alpha-beta fit. On a GPU each record carries the
datasheet's dense peak beside the measured one (`estimator.machines`).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from multigpu import records
from multigpu.experiments.machine import Job, on_gpus

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_SIZES = (256, 512, 1024, 1536, 2048)
GPU_SIZES = (1024, 2048, 4096, 6144, 8192, 12288, 16384)


def _timed(call, device: torch.device, min_time_s: float, max_calls: int) -> list[float]:
    """Seconds of each call of `call()` after one warm-up, until `min_time_s` have passed or `max_calls` ran."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()
    sync()
    times: list[float] = []
    while len(times) < max_calls and (sum(times) < min_time_s or len(times) < 3):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return times


def matmul_rates(device: str, dtype: str, threads: int | None, sizes: tuple[int, ...], min_time_s: float = 0.3,
                 slowest_call_s: float = 2.0) -> list[dict]:
    """FLOP/s of n x n by n x n products (2 n^3 FLOPs) of `dtype` for each n of `sizes` (the larger ones skipped
    once a call takes over `slowest_call_s`): the best call's and the median's."""
    dev = torch.device(device)
    before = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"  # fp32 is fp32: the package never turns TF32 on
    out = []
    try:
        for n in sizes:
            a, b = (torch.randn(n, n, device=dev).to(DTYPES[dtype]) for _ in range(2))
            times = _timed(lambda a=a, b=b: a @ b, dev, min_time_s, max_calls=50)
            flops = 2 * n**3
            out.append({"kind": "matmul", "device": dev.type, "dtype": dtype, "threads": threads, "n": n,
                        "flops": flops, "best_flops_per_s": flops / min(times),
                        "median_flops_per_s": flops / statistics.median(times), "calls": len(times)})
            if min(times) > slowest_call_s:
                break
    finally:
        torch.set_num_threads(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]
    return out


def memory_rate(device: str, threads: int | None, size_bytes: int) -> dict:
    """Bytes a copy of `size_bytes` reads and writes per second (2 x the size per call), best and median."""
    dev = torch.device(device)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(size_bytes // 4, device=dev)
        dst = torch.empty_like(src)
        times = _timed(lambda: dst.copy_(src), dev, min_time_s=0.3, max_calls=50)
    finally:
        torch.set_num_threads(before)
    moved = 2 * src.numel() * 4
    return {"kind": "memory", "device": dev.type, "threads": threads, "bytes": moved,
            "best_bytes_per_s": moved / min(times), "median_bytes_per_s": moved / statistics.median(times),
            "calls": len(times)}


def datasheet(device_name: str) -> dict | None:
    """The dense peaks a GPU's datasheet gives (`estimator.machines.GPU_SHEETS`), if it is one of those GPUs."""
    from multigpu.estimator.machines import sheet_of_device

    gpu = sheet_of_device(device_name)
    if gpu is None:
        return None
    return {"name": gpu.name, "fp32": gpu.fp32_flops, "tf32": gpu.bf16_flops / 2, "bf16": gpu.bf16_flops,
            "fp16": gpu.bf16_flops, "source": gpu.source}


def _limits_records(device: str, threads: int | None) -> list[dict]:
    gpu = device == "cuda"
    # not fp16 on a CPU: where it has no fast path (no AVX512-FP16), a product's speed follows its shape, not its
    # size, and the square sweep's best is no limit (a step's own products ran faster than it)
    rows = [row for dtype in (("fp32", "tf32", "bf16", "fp16") if gpu else ("fp32", "bf16"))
            for row in matmul_rates(device, dtype, threads, GPU_SIZES if gpu else CPU_SIZES)]
    rows.append(memory_rate(device, threads, (2 if gpu else 1) * 2**30 // 4))
    prov = records.provenance("none", 1, device, threads or torch.get_num_threads())
    sheet = datasheet(prov["device_names"][0]) if gpu else None
    return [{**row, "datasheet": sheet, "provenance": prov} for row in rows]


def thread_counts(cores: int) -> list[int]:
    """The CPU thread counts measured: 1, the powers of two below the cores, and every core."""
    return sorted({1, cores, *(2**i for i in range(cores.bit_length()) if 2**i < cores)})


def machine_limits() -> list[Job]:
    """The matmul sweep and the memory copy: on the first GPU if there is one, else on the CPU at each thread
    count of `thread_counts`."""
    if on_gpus(1):
        return [Job("matmul and memory, GPU 0", _limits_records, dict(device="cuda", threads=None))]
    return [Job(f"matmul and memory, {t} thread(s)", _limits_records, dict(device="cpu", threads=t))
            for t in thread_counts(os.cpu_count() or 1)]
