"""Inside a worker: who am I, on which device, talking over which backend.

torchrun starts every worker with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in its environment; `init_process_group` reads them ("env://").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from multigpu.grid import GRID_DIMS, Grid


@dataclass
class RankGrid:
    """The processes as a pp x dp x cp x tp grid (picotron's process-group manager, torchtitan's
    ParallelDims). Rank r sits at (pp, dp, cp, tp) = divmod-wise coordinates of r with tp fastest:
    ranks r and r+1 differ in their tp coordinate. `mesh` is the same grid as a named
    `DeviceMesh` (what PyTorch's FSDP2, tensor parallel and pipelining take); `group(dim)`
    the plain process group of this rank's line along `dim` (what the from-scratch
    strategies pass to every collective)."""

    sizes: dict[str, int]  # {"pp": ..., "dp": ..., "cp": ..., "tp": ...}
    rank: int
    device_type: str = "cpu"
    _mesh: object = None
    _groups: dict = field(default_factory=dict)

    def __post_init__(self):  # a dimension not named has degree 1
        unknown = set(self.sizes) - set(GRID_DIMS)
        assert not unknown, f"unknown grid dimension(s) {unknown}"
        self.sizes = {d: self.sizes.get(d, 1) for d in GRID_DIMS}

    @classmethod
    def build(cls, device_type: str, grid: Grid | None = None, **degrees: int) -> RankGrid:
        """This process's place in `grid` (a run's, resolved and checked by grid.resolve_grid), or
        in the grid of `degrees` (dp=, pp=, tp=, cp=; the tests' and the book's small grids). It must be
        the grid of the processes that started: a mismatch is a bug, not a user's input."""
        grid = grid or Grid(**degrees)
        world = dist.get_world_size() if dist.is_initialized() else 1
        assert grid.size == world, f"{grid} does not tile the {world} processes started"
        return cls({d: getattr(grid, d) for d in GRID_DIMS}, dist.get_rank() if dist.is_initialized() else 0,
                   device_type)

    @property
    def mesh(self):
        """The grid as a DeviceMesh with dimensions named pp, dp, cp, tp (`mesh["tp"]` is this
        rank's TP line). Made on first use, by every rank at the same point of the program
        (creating its groups is a collective call); a plain data-parallel run never needs it."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, tuple(self.sizes[d] for d in GRID_DIMS),
                                          mesh_dim_names=GRID_DIMS)
        return self._mesh

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coord(self, dim: str) -> int:
        """This rank's index along `dim` (its data-parallel rank, its stage, its TP rank)."""
        index = GRID_DIMS.index(dim)
        inner = 1
        for d in GRID_DIMS[index + 1:]:
            inner *= self.sizes[d]
        return (self.rank // inner) % self.sizes[dim]

    def group(self, dim: str):
        """The process group of the ranks that share every coordinate but `dim` with this one.
        A dimension that spans the whole world is the default group itself."""
        if self.sizes[dim] == dist.get_world_size():
            return dist.group.WORLD
        if dim not in self._groups:
            self._groups[dim] = self.mesh.get_group(dim)
        return self._groups[dim]


@dataclass
class Runtime:
    rank: int  # index of this process among all processes (all nodes)
    local_rank: int  # index among the processes of this machine (node)
    world_size: int  # number of processes in the job
    device: torch.device
    backend: str  # "nccl" (CUDA GPUs) or "gloo" (CPU)
    grid: RankGrid | None = None  # the pp x dp x cp x tp grid, built once the run's degrees are known

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# How `device="auto"` resolves on this machine when set: "cpu" keeps every auto run on the CPU
# (the test suite sets it, so that it reaches the workers, subprocesses and notebook kernels it
# starts); "cuda" makes auto ask for the GPUs. A run that names its device is not affected.
DEVICE_ENV = "MULTIGPU_DEVICE"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class DevicePlan:
    """Which device and backend every rank of one launch gets, decided before anything starts
    (`plan_devices`). `gpus`: the GPU index of each local rank of this node (one-process
    strategies: of each replica), () on the CPU."""

    device: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo" (a one-process run still joins a group of one)
    gpus: tuple[int, ...]
    why: str

    @property
    def first_gpu(self) -> int:
        """Local rank r of this node runs on GPU first_gpu + r."""
        return self.gpus[0] if self.gpus else 0

    def visible_devices(self, current: str | None) -> str | None:
        """CUDA_VISIBLE_DEVICES for this node's workers when their GPUs do not start at GPU 0 (a
        stand-in node beyond the first): its GPUs, as the machine numbers them (through
        `current`, a CUDA_VISIBLE_DEVICES already set), so that local rank r is cuda:r for torch
        and for every library that goes by LOCAL_RANK alone (DeepSpeed). None: nothing to hide."""
        if self.device != "cuda" or self.first_gpu == 0:
            return None
        shown = [d.strip() for d in current.split(",")] if current and current.strip() else None
        return ",".join(shown[g] if shown else str(g) for g in self.gpus)


def plan_devices(requested: str, *, processes: int, gpus: int, replicas: int = 1, nnodes: int = 1,
                 nodes_here: int = 1, node_rank: int = 0, cuda_only: str | None = None) -> DevicePlan:
    """The one rule for devices, a pure function of what a launch is and what the machine has.

    requested: "auto", "cpu" or "cuda" (already resolved against MULTIGPU_DEVICE).
    processes: the worker processes this node starts; replicas: the devices each process
    drives itself (DataParallel's replicas are threads of one process; otherwise 1).
    gpus: the CUDA GPUs this machine shows. nnodes: the nodes of the job; nodes_here: how many
    of them run on this very machine (stand-in nodes on a loopback rendezvous share its GPUs:
    each takes its own GPUs, node_rank's block).

    NCCL refuses two ranks of one communicator on one GPU, and DataParallel needs a GPU per
    replica: CUDA is used only with a GPU for every rank (or replica) on this machine. Asked
    for by name and short of GPUs, the plan is refused with the count; `auto` falls back to the
    CPU and gloo, and says why. `cuda_only`: why the run needs CUDA (a strategy that cannot run on
    a CPU), which then refuses the CPU instead of falling back to it."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    for name, value in (("processes", processes), ("replicas", replicas), ("nnodes", nnodes),
                        ("nodes_here", nodes_here)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be a whole number >= 0, got {gpus!r}")
    if nodes_here > nnodes or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} / nodes_here {nodes_here} do not fit {nnodes} node(s)")
    per_node = processes * replicas  # devices one node drives
    needed = per_node * nodes_here  # GPUs this machine must have, one per rank or replica
    what = (f"{replicas} replicas" if replicas > 1 else f"{processes} process(es)") + (
        f" on each of {nodes_here} nodes on this machine" if nodes_here > 1 else "")
    if cuda_only and (requested == "cpu" or gpus < needed):
        raise ValueError(f"{cuda_only}. It needs a CUDA GPU for each of {what} ({needed} in all); this machine has "
                         f"{gpus}" + (" and device='cpu' was asked" if requested == "cpu" else ""))
    if requested == "cpu":
        return DevicePlan("cpu", "gloo", (), "gloo on CPU (as asked)")
    if gpus >= needed:
        first = (node_rank % nodes_here) * per_node
        where = f"GPUs {first}-{first + per_node - 1}" if per_node > 1 else f"GPU {first}"
        return DevicePlan("cuda", "nccl", tuple(range(first, first + per_node)),
                          f"NCCL on {where} of {gpus} CUDA GPU(s)")
    if requested == "cuda":
        raise ValueError(
            f"device='cuda' needs a CUDA GPU for each of {what} ({needed} in all; NCCL refuses two ranks on "
            f"one GPU), this machine has {gpus}; use device='cpu' or 'auto' (gloo on the CPU), or fewer "
            "processes")
    return DevicePlan("cpu", "gloo", (), f"gloo on CPU (this machine has {gpus} CUDA GPU(s) for {what})")


def machine_gpus() -> int:
    """The CUDA GPUs this machine shows (device_count makes no CUDA context)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_requested(requested: str) -> str:
    """`auto` as MULTIGPU_DEVICE says it should resolve here; a named device is kept."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced and forced not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={forced!r} must be auto, cpu or cuda (or unset)")
    return forced if requested == "auto" and forced else requested


def device_plan(cfg, *, nnodes: int = 1, node_rank: int = 0, nodes_here: int = 1,
                gpus: int | None = None) -> DevicePlan:
    """`plan_devices` for a RunConfig as `launch` starts it on this machine: what is used by
    `launch`, `check`, the experiments and the chapters. `gpus`: the machine's GPU count
    (default: this machine's)."""
    one_process = cfg.info.one_process and cfg.info.spans != "none"  # dp: replicas in one process
    return plan_devices(resolve_requested(cfg.device), processes=cfg.processes // nnodes,
                        replicas=cfg.world_size if one_process else 1,
                        gpus=machine_gpus() if gpus is None else gpus,
                        nnodes=nnodes, nodes_here=nodes_here, node_rank=node_rank,
                        cuda_only=cfg.info.cuda_only and f"strategy {cfg.strategy!r}: {cfg.info.cuda_only}")


def choose_device(requested: str, world_size: int) -> tuple[str, str, str]:
    """(device, backend, why) for `world_size` processes of one node on this machine: the
    device plan's answer for a plain multi-process run."""
    plan = plan_devices(resolve_requested(requested), processes=world_size, gpus=machine_gpus())
    return plan.device, plan.backend, plan.why


def restart_count() -> int:
    """How many times torchrun has started this worker's attempt again after a failure (--max-restarts): 0 in
    the first attempt, and outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init(device_type: str, timeout_s: float = 300) -> Runtime:
    """Join the process group torchrun set up; pin this process to its GPU if any (local rank r
    takes cuda:r of the GPUs the launcher left visible: the device plan's)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        if interface := gloo_interface():  # for the checkpoints' gloo group beside NCCL (check_host_group)
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    else:
        device, backend = torch.device("cpu"), "gloo"
    # device_id binds NCCL to this GPU now: start-up errors surface here, and barriers know
    # their device (without it rank 0 warns "using the device under current context")
    restart = restart_count()
    store = None
    if restart:  # torchrun's store outlives a restart, and the failed attempt's process groups left their
        # peers' addresses in it under the same names: a new group would dial the dead workers and wait for good
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                           timeout=timedelta(seconds=timeout_s)))
        store = dist.PrefixStore(f"restart-{restart}/", store)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device_type == "cuda" else None,
                            **({"store": store, "rank": rank, "world_size": world_size} if store else {}))
    return Runtime(rank, local_rank, world_size, device, backend)


def gloo_interface(environ=os.environ, names: list[str] | None = None) -> str | None:
    """The network interface gloo's groups should use when only NCCL_SOCKET_IFNAME names one: NCCL's
    first match among this machine's interfaces (`names`), its entries prefixes ("eth"), or exact
    names after "=" ("=eth0"). None: GLOO_SOCKET_IFNAME is set already, NCCL's is unset or an
    exclusion ("^docker"), or nothing here matches it."""
    import socket

    spec = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if environ.get("GLOO_SOCKET_IFNAME") or not spec or spec.startswith("^"):
        return None
    exact, spec = spec.startswith("="), spec.removeprefix("=")
    names = [name for _, name in socket.if_nameindex()] if names is None else names
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        found = [n for n in names if n == entry or (not exact and n.startswith(entry))]
        if found:
            return found[0]
    return None


def check_host_group(timeout_s: float = 300) -> None:
    """Make and drop a gloo group over every rank, as checkpoints make theirs (at a run's first save or
    resume). Gloo binds to the address the host name resolves to, or to GLOO_SOCKET_IFNAME's interface;
    across nodes that must be routable, which NCCL alone (its own interface) never needed: a run on
    NCCL that checkpoints checks it here, at its start, not at its first save."""
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        dist.barrier(group=group)
    except RuntimeError as err:
        raise RuntimeError(
            f"checkpoints need a gloo group over every rank, and gloo could not make one "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}): set GLOO_SOCKET_IFNAME to "
            f"the network interface the nodes reach each other on (NCCL_SOCKET_IFNAME's, if it names one)"
        ) from None
    dist.destroy_process_group(group)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def process_groups() -> list:
    """The process groups this process is in (WORLD's too), in the order they were made: the same order on
    every rank, since making a group is collective."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _kept_by_deepspeed() -> set:
    """The groups DeepSpeed keeps for its next engine in this process (deepspeed.utils.groups holds them by name
    and hands them out again: destroyed, they would fail the next run)."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    found = set()
    for value in vars(groups).values() if groups else ():
        for g in value.values() if isinstance(value, dict) else (value,):
            if isinstance(g, dist.ProcessGroup):
                found.add(g)
            elif isinstance(g, dist.DeviceMesh):  # its mesh_device, where a config asks for one
                found.update(g.get_all_groups())
    return found


def destroy_groups_since(before: list, device: torch.device) -> int:
    """Destroy the process groups made since `before` (an earlier process_groups()), in the order they were
    made, but those DeepSpeed keeps; return how many. On every rank between two runs of a series: each NCCL
    communicator a run used holds buffers on the GPU, outside the caching allocator, until it is destroyed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # nothing of the run still queued on a communicator's stream
    kept = set(before) | _kept_by_deepspeed()
    made = [g for g in process_groups() if g not in kept]
    for group in made:
        dist.destroy_process_group(group)
    return len(made)
