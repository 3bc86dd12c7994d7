"""What one GPU's kernels achieve, as `multigpu.estimator.kernels` prices them: the matrix
product's rate by size, the memory's bandwidth, and the host's time per kernel launched.

- A GPU with records (experiment `machine_limits`, `experiments.limits`: square products swept
  by size and dtype, each call timed to its end, and a large copy) is priced from them, measured.
  Each size's rate is the best call's, as measured (its launch and wait included). A call of the
  sweep is the host launching one kernel and waiting for it; its smallest product does little
  arithmetic, so what the smallest call takes beyond its FLOPs at the dtype's best rate is the
  cost of one kernel's launch (`launch_s`, the least over dtypes).
- A GPU without records is priced from its datasheet: its dense peak times the share of it the
  ML Engineering book measured as the best achievable matmul (MAMF; Bekman, "Machine Learning
  Engineering", compute/accelerator/README.md, table "Maximum Achievable Matmul FLOPS
  comparison table", stas00/ml-engineering @ 744d01e: A100 SXM 271.2 of 312 TFLOPS in BF16,
  A100 PCIe 252.9, H100 SXM 794.5 of 989, the H200 the same chip), flat in size; fp32 at the
  same share of its own peak (an assumption); the memory at its datasheet bandwidth times the
  share the recorded GPU's copy reached of its own (an assumption), and the recorded GPU's
  launch cost (the host's, taken as the same on any machine: an assumption). It says so in
  `notes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from multigpu.errors import ConfigError

# datasheet memory bandwidth, bytes/s (NVIDIA's datasheets for each GPU)
MEMORY_BANDWIDTH = {
    "v100-16gb": 900e9, "v100-32gb": 900e9,  # V100 SXM2: 900 GB/s HBM2
    "a10-24gb": 600e9,  # A10: 600 GB/s GDDR6
    "a100-40gb": 1555e9,  # A100 40GB SXM: 1,555 GB/s HBM2
    "a100-80gb": 2039e9,  # A100 80GB SXM: 2,039 GB/s HBM2e
    "l4-24gb": 300e9,  # L4: 300 GB/s
    "l40s-48gb": 864e9,  # L40S: 864 GB/s
    "h100-80gb": 3.35e12,  # H100 SXM: 3.35 TB/s HBM3
    "h200-141gb": 4.8e12,  # H200 SXM: 4.8 TB/s HBM3e
    "rtx4090-24gb": 1008e9,  # RTX 4090: 1,008 GB/s GDDR6X
}
# the ML Engineering book's MAMF table (see the module's docstring): best achievable BF16 matmul / dense peak
MAMF_SHARE = {
    "a100-40gb": 271.2 / 312, "a100-80gb": 271.2 / 312,  # A100 SXM (the 40 GB card: the same chip)
    "h100-80gb": 794.5 / 989, "h200-141gb": 794.5 / 989,  # H100 SXM; the table: "H200 same"
}
MAMF_SOURCE = ("the ML Engineering book's MAMF table (stas00/ml-engineering, compute/accelerator/README.md @ "
               "744d01e)")


@dataclass(frozen=True)
class Compute:
    """One GPU's rates. `curves`: per dtype ("fp32", "bf16", "fp16"), (size, FLOP/s) of its products, by
    size (the cube root of m n k), rising; `bandwidth`: bytes/s; `launch_s`: the host's time per kernel."""

    name: str
    curves: dict
    bandwidth: float
    launch_s: float
    measured: bool
    notes: tuple = ()

    def product_rate(self, dtype: str, size: float) -> float:
        """FLOP/s of a product of `dtype` and `size`: between two swept sizes on the line in log size, below
        the smallest the smallest's, above the largest the largest's."""
        curve = self.curves["bf16" if dtype == "fp16" and "fp16" not in self.curves else dtype]
        if size <= curve[0][0]:
            return curve[0][1]
        for (n0, r0), (n1, r1) in zip(curve, curve[1:]):
            if size <= n1:
                w = math.log(size / n0) / math.log(n1 / n0)
                return r0 + w * (r1 - r0)
        return curve[-1][1]


def _best_by_size(limits: list[dict], dtype: str) -> list[tuple[int, float]]:
    best: dict = {}
    for r in limits:
        if r["kind"] == "matmul" and r["dtype"] == dtype:
            best[r["n"]] = max(best.get(r["n"], 0.0), r["best_flops_per_s"])
    return sorted(best.items())


def measured_compute(limits: list[dict], name: str) -> Compute:
    """A GPU's `Compute` from its `machine_limits` records (see the module's docstring)."""
    sweeps = {d: _best_by_size(limits, d) for d in ("fp32", "bf16", "fp16")}
    sweeps = {d: s for d, s in sweeps.items() if s}
    copies = [r["best_bytes_per_s"] for r in limits if r["kind"] == "memory"]
    if "fp32" not in sweeps or "bf16" not in sweeps or not copies:
        raise ConfigError(f"{name}: its machine_limits records lack the fp32 or bf16 sweep or the copy; run "
                          "`python -m multigpu figures --experiments machine_limits` on it")
    launch = min(2 * n**3 / rate - 2 * n**3 / max(r for _, r in s) for s in sweeps.values() for n, rate in s[:1])
    curves = {d: tuple(s) for d, s in sweeps.items()}
    return Compute(name, curves, max(copies), launch, True,
                   (f"measured: the matmul sweep and the copy of experiment machine_limits on {name}; a kernel's "
                    f"launch {launch * 1e6:.1f} us, the sweep's smallest call beyond its arithmetic",))


def recorded_gpus() -> dict[str, tuple[str, list[dict]]]:
    """{GPU_SHEETS key: (machine tag, its machine_limits records)} for every machine of the results with a GPU's."""
    from multigpu import records
    from multigpu.estimator.machines import GPU_SHEETS, sheet_of_device

    found = {}
    for tag in records.machines_with("machine_limits"):
        rows = [r for r in records.load("machine_limits", tag) if r.get("device") == "cuda"]
        if rows:
            sheet = sheet_of_device(rows[0]["provenance"]["device_names"][0])
            key = next((k for k, g in GPU_SHEETS.items() if g is sheet), None)
            if key and key not in found:
                found[key] = (tag, rows)
    return found


@lru_cache(maxsize=16)
def gpu_compute(gpu: str) -> Compute:
    """The `Compute` of GPU `gpu` (a key of `machines.GPU_SHEETS`): measured where a machine of the results has
    one, else from its datasheet and the MAMF share; a GPU with neither is refused, naming those that can be."""
    from multigpu.estimator.machines import GPU_SHEETS

    recorded = recorded_gpus()
    if gpu in recorded:
        tag, rows = recorded[gpu]
        return measured_compute(rows, tag)
    if gpu not in MAMF_SHARE or gpu not in GPU_SHEETS:
        known = sorted(set(MAMF_SHARE) | set(recorded))
        raise ConfigError(f"no measured or published matmul rate for GPU {gpu!r}; give --gpu one of: "
                          f"{', '.join(known)}")
    if not recorded:
        raise ConfigError("no GPU's machine_limits records to take a kernel's launch cost from; run "
                          "`python -m multigpu figures --experiments machine_limits` on a GPU")
    ref_key, (ref_tag, ref_rows) = next(iter(recorded.items()))
    ref = measured_compute(ref_rows, ref_tag)
    sheet, share = GPU_SHEETS[gpu], MAMF_SHARE[gpu]
    copy_share = ref.bandwidth / MEMORY_BANDWIDTH[ref_key]
    bf16 = sheet.bf16_flops * share
    curves = {"bf16": ((1, bf16),), "fp16": ((1, bf16),), "fp32": ((1, sheet.fp32_flops * share),)}
    notes = (f"from the datasheet ({sheet.source}): BF16 at {share:.1%} of the dense peak, {MAMF_SOURCE}; fp32 "
             "at the same share of its peak (assumption)",
             f"memory: the datasheet's {MEMORY_BANDWIDTH[gpu] / 1e12:.2f} TB/s at the {copy_share:.0%} that "
             f"{ref_tag}'s copy reached of its own (assumption)",
             f"a kernel's launch: {ref.launch_s * 1e6:.1f} us, measured on {ref_tag} (assumption: the host's "
             "cost, the same on any machine)")
    return Compute(sheet.name, curves, MEMORY_BANDWIDTH[gpu] * copy_share, ref.launch_s, False, notes)
