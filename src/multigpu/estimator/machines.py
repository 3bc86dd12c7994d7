"""Machines as numbers: a GPU (its memory and peak dense FLOP/s, and the share of that peak a
training step achieves) times GPUs per node times nodes, with two links: between the GPUs of
a node, and between nodes. Every number names its source; one that is not from a datasheet
or a record is called an assumption, here and in what `describe` prints.

A link is Hockney's latency-bandwidth model, as in `multigpu.comm`: a collective that makes
each rank send S bytes takes alpha + S / bandwidth, with S what the ring algorithm sends
(`comm.sent_bytes`, e.g. 2(N-1)/N of the payload for an all-reduce). Bandwidths are the
datasheets' per direction, an upper bound on what collectives achieve.

`multigpu.estimator.step_time` times a training step on them; its `recorded_machine` is the
machine that made the records, measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from multigpu.comm import sent_bytes
from multigpu.errors import ConfigError
from multigpu.estimator.question import GPUS


@dataclass(frozen=True)
class Link:
    """One kind of link, as the alpha-beta model sees it."""

    name: str
    bandwidth_bytes_per_s: float  # one direction: per GPU inside a node, per node between nodes
    alpha_s: float  # the fixed cost of one collective call
    source: str
    alpha_source: str = ("assumption: a few microseconds of link latency plus a collective's launch and "
                         "synchronisation, taken as 10 us per call inside a node")
    fits: tuple = ()  # measured: (collective, alpha_s, seconds per byte sent), one per collective timed

    def seconds(self, kind: str, payload_bytes: float, ranks: int, share: float = 1.0, calls: int = 1) -> float:
        """`calls` calls of collective `kind` on `ranks` ranks that hand it `payload_bytes` in
        all (an all-gather: the shards), when this flow gets `share` of the link's bandwidth.
        A measured link times each collective by its own fit (a send as an all-gather, which
        sends its payload once)."""
        if ranks == 1 or calls == 0:
            return 0.0
        fitted = {k: (a, b) for k, a, b in self.fits}
        alpha, beta = fitted.get("all_gather" if kind == "send" else kind,
                                 (self.alpha_s, 1 / self.bandwidth_bytes_per_s))
        return calls * alpha + sent_bytes(kind, payload_bytes, ranks) * beta / share


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_flops: float  # peak dense FLOP/s, bf16 tensor cores
    fp32_flops: float  # peak FP32 FLOP/s (PyTorch does not use TF32 for matmuls by default)
    source: str


@dataclass(frozen=True)
class Machine:
    name: str
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link  # between the GPUs of a node
    inter: Link | None  # between nodes
    fast_between_nodes: bool = True  # the guide's "fast inter-node connectivity"
    mfu: float = 0.40  # achieved share of the peak FLOP/s
    mfu_source: str = (
        "assumption: 40% of the peak, the middle of reported training runs (picotron: 38% MFU for "
        "LLaMA-2-7B on 64 H100 and about 50% for SmolLM-1.7B on 8; torchtitan: 33-39% for Llama 3.1 8B "
        "with FSDP on 8 H100; Llama 3 405B: 38-43%, Dubey et al. 2024), taken as the rate of the compute "
        "alone, the same for every strategy and micro-batch")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def flops_per_s(self, dtype: str) -> float:
        """Achieved FLOP/s of one GPU: bf16 tensor cores for the mixed precisions, else FP32."""
        return self.mfu * (self.gpu.fp32_flops if dtype == "fp32" else self.gpu.bf16_flops)


# -- the catalogue ----------------------------------------------------------------------------

H100_SXM = GPU("H100 SXM5 80GB", GPUS["h100-80gb"], 989e12, 67e12,
               "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), FP32 "
               "67 TFLOPS, 80 GB")
A100_SXM = GPU("A100 SXM4 80GB", GPUS["a100-80gb"], 312e12, 19.5e12,
               "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, 80 GB")
A100_PCIE = GPU("A100 PCIe 80GB", GPUS["a100-80gb"], 312e12, 19.5e12,
                "NVIDIA A100 Tensor Core GPU datasheet (PCIe): BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, 80 GB")

V100_SXM2 = GPU("V100 SXM2 32GB", GPUS["v100-32gb"], 125e12, 15.7e12,
                "NVIDIA V100 Tensor Core GPU datasheet (SXM2): Tensor Performance 125 TFLOPS, FP32 15.7 TFLOPS. "
                "Volta's tensor cores compute fp16, not bf16: the 16-bit rate is fp16-mixed's")

# every GPU `--gpu` names (question.GPUS), with its own datasheet's dense peaks: a named GPU computes as
# itself, not as an H100. Datasheets give 16-bit tensor-core rates with sparsity; these are the dense halves.
GPU_SHEETS = {
    "v100-16gb": replace(V100_SXM2, name="V100 SXM2 16GB", memory_bytes=GPUS["v100-16gb"]),
    "v100-32gb": V100_SXM2,
    "a10-24gb": GPU("A10 24GB", GPUS["a10-24gb"], 125e12, 31.2e12,
                    "NVIDIA A10 Tensor Core GPU datasheet: BF16 Tensor Core 125 TFLOPS (250 with sparsity), FP32 "
                    "31.2 TFLOPS"),
    "a100-40gb": GPU("A100 SXM4 40GB", GPUS["a100-40gb"], 312e12, 19.5e12,
                     "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, 40 GB"),
    "a100-80gb": A100_SXM,
    "l4-24gb": GPU("L4 24GB", GPUS["l4-24gb"], 121e12, 30.3e12,
                   "NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with sparsity (121 dense), "
                   "FP32 30.3 TFLOPS"),
    "l40s-48gb": GPU("L40S 48GB", GPUS["l40s-48gb"], 362e12, 91.6e12,
                     "NVIDIA L40S GPU datasheet: BF16 Tensor Core 362 TFLOPS (733 with sparsity), FP32 91.6 TFLOPS"),
    "h100-80gb": H100_SXM,
    "h200-141gb": GPU("H200 SXM 141GB", GPUS["h200-141gb"], 989e12, 67e12,
                      "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity "
                      "(989 dense), FP32 67 TFLOPS, 141 GB"),
    "rtx4090-24gb": GPU("GeForce RTX 4090", GPUS["rtx4090-24gb"], 165.2e12, 82.6e12,
                        "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: BF16 tensor 165.2 TFLOPS dense "
                        "with FP32 accumulate (330.4 with sparsity), FP32 82.6 TFLOPS"),
}
# how CUDA names them (torch.cuda.get_device_name), longest first: "A10" is in "A100", "L4" in "L40S"
_DEVICE_NAMES = (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
                 ("A100-PCIE-40GB", "a100-40gb"), ("A100", "a100-80gb"), ("A10", "a10-24gb"),
                 ("L40S", "l40s-48gb"), ("L4", "l4-24gb"), ("V100", "v100-32gb"), ("RTX 4090", "rtx4090-24gb"))


def sheet_of_device(device_name: str) -> GPU | None:
    """The catalogue's GPU for a name CUDA reports ('NVIDIA H200', 'NVIDIA A100-SXM4-40GB'), or None."""
    for word, key in _DEVICE_NAMES:
        if word in device_name:
            return GPU_SHEETS[key]
    return None


NVLINK4 = Link("NVLink 4 through NVSwitch", 450e9, 10e-6,
               "NVIDIA H100 datasheet: 900 GB/s of NVLink per GPU, both directions together")
NVLINK3 = Link("NVLink 3 through NVSwitch", 300e9, 10e-6,
               "NVIDIA A100 datasheet: 600 GB/s of NVLink per GPU, both directions together")
NVLINK2 = Link("NVLink 2 (V100 SXM2)", 150e9, 10e-6,
               "NVIDIA V100 datasheet (SXM2): 300 GB/s of NVLink per GPU, both directions together")
PCIE4 = Link("PCIe Gen4 x16", 31.5e9, 10e-6,
             "PCI-SIG PCIe 4.0: 16 GT/s per lane x 16 lanes, 128b/130b encoding = 31.5 GB/s each way")
_NETWORK_ALPHA = "assumption: 20 us per collective call between nodes (a network hop is slower than NVLink)"
IB_NDR_X8 = Link("8 x 400 Gb/s InfiniBand NDR per node", 8 * 50e9, 20e-6,
                 "NVIDIA DGX H100: eight ConnectX-7 400 Gb/s ports for the compute network; 400 Gb/s = 50 GB/s",
                 _NETWORK_ALPHA)
ETH_100G = Link("one 100 Gb/s Ethernet port per node", 12.5e9, 20e-6,
                "IEEE 802.3 100 Gb/s Ethernet: 12.5 GB/s; one port per node is an assumption", _NETWORK_ALPHA)

MACHINES = {
    "8xh100-nvlink": Machine("8 x H100 SXM, NVLink 4", H100_SXM, 8, 1, NVLINK4, IB_NDR_X8),
    # the machine of the sources' chart: 8 A100 with 600 GB/s NVLink
    "8xa100-nvlink": Machine("8 x A100 SXM 80GB, NVLink 3", A100_SXM, 8, 1, NVLINK3, IB_NDR_X8),
    "8xa100-pcie": Machine("8 x A100 PCIe 80GB, PCIe Gen4, no NVLink", A100_PCIE, 8, 1, PCIE4, ETH_100G,
                           fast_between_nodes=False),
    "2x8xh100-ib": Machine("2 nodes x 8 H100 SXM, NVLink 4 inside, 8 x 400 Gb/s InfiniBand between", H100_SXM, 8,
                           2, NVLINK4, IB_NDR_X8),
    "2x8xh100-100g": Machine("2 nodes x 8 H100 SXM, NVLink 4 inside, 100 Gb/s Ethernet between", H100_SXM, 8, 2,
                             NVLINK4, ETH_100G, fast_between_nodes=False),
}


def generic_machine(gpus: int, nodes: int, memory_bytes: int, fast: bool, gpu: str | None = None) -> Machine:
    """A machine given only by counts and memory (the CLI's --gpus --nodes --gpu-memory
    --interconnect), and perhaps the GPU's name (--gpu, a key of GPU_SHEETS), which brings that
    GPU's datasheet peaks; without one, H100 SXM compute (an assumption, said by its name). Links:
    inside a node the named GPU's own (V100: NVLink 2, A100: NVLink 3, H100/H200: NVLink 4, cards: PCIe
    Gen4; NVLink 4 without a name), and between nodes 8 x 400 Gb/s InfiniBand (fast) or one 100 Gb/s
    Ethernet port (slow), assumed whatever the GPU."""
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ConfigError(f"--gpus ({gpus}) must be a positive multiple of --nodes ({nodes})")
    if gpu is not None and gpu not in GPU_SHEETS:
        raise ConfigError(f"unknown GPU {gpu!r}; choose one of: {', '.join(GPU_SHEETS)}")
    chip = replace(GPU_SHEETS[gpu], name=f"{GPU_SHEETS[gpu].name} ({memory_bytes / 2**30:.0f} GiB)",
                   memory_bytes=memory_bytes) if gpu else \
        replace(H100_SXM, name=f"a GPU of {memory_bytes / 2**30:.0f} GiB, computing as an H100 SXM (assumption)",
                memory_bytes=memory_bytes)
    intra = _LINK_OF.get(gpu, NVLINK4)
    return Machine(f"{gpus} GPUs in {nodes} node(s), {intra.name} inside, {'fast' if fast else 'slow'} links "
                   "between (assumed)", chip, gpus // nodes, nodes, intra, IB_NDR_X8 if fast else ETH_100G,
                   fast_between_nodes=fast)


# the link inside a node that each named GPU comes with (SXM boards: their NVLink generation; cards: PCIe)
_LINK_OF = {"v100-16gb": NVLINK2, "v100-32gb": NVLINK2, "a100-40gb": NVLINK3, "a100-80gb": NVLINK3,
            "h100-80gb": NVLINK4, "h200-141gb": NVLINK4, "a10-24gb": PCIE4, "l4-24gb": PCIE4, "l40s-48gb": PCIE4,
            "rtx4090-24gb": PCIE4}


def describe(machine: Machine) -> list[str]:
    """The machine's numbers, each with its source (or 'assumption')."""
    lines = [f"{machine.name}: {machine.nodes} node(s) of {machine.gpus_per_node} {machine.gpu.name} "
             f"({machine.gpu.source})",
             f"compute: {machine.mfu:.0%} of the peak ({machine.mfu_source})",
             f"inside a node: {machine.intra.name}, {machine.intra.bandwidth_bytes_per_s / 1e9:.1f} GB/s each way "
             f"per GPU ({machine.intra.source}); {machine.intra.alpha_source}"]
    if machine.nodes > 1 and machine.inter is not None:
        lines.append(f"between nodes: {machine.inter.name}, {machine.inter.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
                     f"each way per node ({machine.inter.source}); {machine.inter.alpha_source}")
    return lines

