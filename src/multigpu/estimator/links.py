"""Links priced by published collective curves, not a datasheet's bandwidth with a guessed latency.

A collective call of S bytes takes S x (the ring's factor, `comm.sent_bytes`) / busbw(S): nccl-tests'
bus bandwidth, read off a curve measured by message size on a named machine (between two sizes on
the line in log size; below the smallest the smallest's time, the latency; above the largest the
largest's bandwidth). The curves' latency is in their small sizes: a 32 KiB all-reduce across 8
A100s takes about 44 us, and a 1 MiB one runs at 18 GB/s, not the 234 GB/s of a large one.

Sources (every number below):
- inside a node, all-reduce on 8 GPUs: Bekman, "Machine Learning Engineering", network/README.md
  (stas00/ml-engineering @ 744d01e18b79512572f64a6bbd8b5f4a725203a7): the nccl-tests sweep of an
  8 x A100 NVLink 3 node (32 KiB to 16 GiB), and of an 8 x H200 NVLink 4 node (the same NVLink 4
  and NVSwitch as a DGX H100; NVLS from 2 MiB); there, with NVLS off, 16 GiB all-gather 361.4 and
  reduce-scatter 362.9 GB/s on the H200s: their ceiling, which NVLS does not raise;
- between nodes: the same page's all-reduce on 4 nodes x 8 B200 over EFA v4 (8 x 50 GB/s per node,
  400 Gb/s per GPU: a DGX H100's eight 400 Gb/s NDR ports give the same per-GPU rate, so the curve
  is taken as a DGX H100's, an assumption); a DGX A100's eight 200 Gb/s HDR ports are half the
  rate: the same curve's bandwidth halved (an assumption).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from multigpu.comm import sent_bytes
from multigpu.estimator.machines import Link

ML_ENGINEERING = "stas00/ml-engineering network/README.md @ 744d01e (nccl-tests)"
SIZES = tuple(2**i for i in range(15, 35))  # 32 KiB .. 16 GiB, the sweeps' sizes
A100_NVLINK3 = (1.31, 2.45, 4.43, 7.47, 11.41, 18.0, 36.18, 72.33, 109.93, 106.16, 138.49, 171.54, 176.92, 194.07,
                222.72, 229.04, 231.41, 233.88, 234.61, 234.89)  # GB/s, all-reduce, 8 x A100 SXM, one node
H200_NVLINK4 = (1.44, 2.93, 5.73, 11.74, 23.94, 39.93, 64.53, 107.16, 155.53, 219.89, 275.84, 346.51, 401.93, 436.15,
                450.29, 463.58, 469.17, 473.1, 477.45, 482.26)  # GB/s, all-reduce, 8 x H200, one node
B200_4NODES_EFA = (0.01, 0.04, 0.45, 1.33, 2.84, 5.37, 10.38, 18.9, 35.12, 64.43, 91.19, 156.74, 197.94, 229.09,
                   326.9, 361.99, 372.42, 377.34, 380.39, 381.8)  # GB/s, all-reduce, 32 ranks on 4 nodes


@dataclass(frozen=True)
class CurveLink(Link):
    """A link priced by a measured bus-bandwidth curve: `curve` ((bytes, bytes/s), ...) rising in bytes;
    `ceilings`: {collective: bytes/s} where a kind tops out below the curve (all-reduce's NVLS)."""

    curve: tuple = ()
    ceilings: tuple = ()

    def busbw(self, kind: str, message_bytes: float) -> float:
        """The bus bandwidth of one call of `kind` moving a message of `message_bytes`."""
        sizes, rates = zip(*self.curve)
        if message_bytes <= sizes[0]:
            rate = rates[0] * message_bytes / sizes[0]  # below the sweep: the smallest call's time, its latency
        elif message_bytes >= sizes[-1]:
            rate = rates[-1]
        else:
            i = next(j for j in range(1, len(sizes)) if message_bytes <= sizes[j])
            w = math.log(message_bytes / sizes[i - 1]) / math.log(sizes[i] / sizes[i - 1])
            rate = rates[i - 1] + w * (rates[i] - rates[i - 1])
        return max(min(rate, dict(self.ceilings).get(kind, rate)), 1e-30)

    def seconds(self, kind: str, payload_bytes: float, ranks: int, share: float = 1.0, calls: int = 1) -> float:
        """`calls` calls of `kind` on `ranks` ranks handing in `payload_bytes` in all, at `share` of the link:
        each call's bytes on the ring over the curve's bus bandwidth at that call's message (an all-gather's:
        every shard)."""
        if ranks == 1 or calls == 0 or payload_bytes <= 0:
            return 0.0
        per_call = payload_bytes / calls
        message = per_call * ranks if kind == "all_gather" else per_call
        sent = sent_bytes("all_gather" if kind == "send" else kind, per_call, 2 if kind == "send" else ranks)
        return calls * sent / (self.busbw(kind, message) * share)


def _curve(gbps: tuple, scale: float = 1.0) -> tuple:
    return tuple((size, rate * 1e9 * scale) for size, rate in zip(SIZES, gbps))


NVLINK3_MEASURED = CurveLink(
    "NVLink 3 through NVSwitch (8 x A100), nccl-tests", 234.89e9, 0.0,
    f"measured: all-reduce bus bandwidth by size on 8 x A100 SXM, {ML_ENGINEERING}",
    "measured: the latency is the curve's small messages", curve=_curve(A100_NVLINK3))
NVLINK4_MEASURED = CurveLink(
    "NVLink 4 through NVSwitch (8 x H100/H200), nccl-tests", 482.26e9, 0.0,
    f"measured: all-reduce bus bandwidth by size on 8 x H200 (NVLink 4, as a DGX H100's), {ML_ENGINEERING}; "
    "all-gather and reduce-scatter capped at their 16 GiB ring figures (361.4, 362.9 GB/s)",
    "measured: the latency is the curve's small messages", curve=_curve(H200_NVLINK4),
    ceilings=(("all_gather", 361.4e9), ("reduce_scatter", 362.9e9), ("all_to_all", 361.4e9),
              ("send", 361.4e9), ("broadcast", 361.4e9), ("reduce", 362.9e9)))
NDR_MEASURED = CurveLink(
    "8 x 400 Gb/s per node (DGX H100's NDR InfiniBand), priced by EFA v4's curve", 381.8e9, 0.0,
    f"measured: all-reduce bus bandwidth by size on 4 nodes x 8 B200 over EFA v4 (400 Gb/s per GPU), "
    f"{ML_ENGINEERING}; taken for NDR at the same rate per GPU (assumption)",
    "measured: the latency is the curve's small messages", curve=_curve(B200_4NODES_EFA))
HDR_MEASURED = CurveLink(
    "8 x 200 Gb/s per node (DGX A100's HDR InfiniBand), priced by EFA v4's curve halved", 381.8e9 / 2, 0.0,
    f"the 4-node EFA v4 curve ({ML_ENGINEERING}) at half the bandwidth: 200 Gb/s per GPU, not 400 (assumption)",
    "measured: the latency is the curve's small messages", curve=_curve(B200_4NODES_EFA, 0.5))
