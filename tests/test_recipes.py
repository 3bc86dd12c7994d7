"""The multi-node recipes in recipes/, each checked with the tool's own parser.

There is no cluster, Slurm, pdsh or GPU here. The shell scripts run under bash with stub
commands on PATH (srun, scontrol, python, torchrun, deepspeed, accelerate) that record their
arguments, environment and working directory; what they recorded then goes through the real
parsers: multigpu's own command line (`multigpu.__main__.build_parser`) and worker
(`multigpu.worker.main`), torchrun's (`torch.distributed.run`), DeepSpeed's runner, pdsh
runner and per-node launcher, and accelerate's launch command. No training process starts.

RunConfigs are validated with `multigpu.config.max_cpu_workers` raised to 64: validate()
refuses more processes than this CPU machine could run usefully (max(8, 4 x its cores)), a
limit that a run of 16 GPU processes on two GPU nodes is not bound by.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import multigpu.config
from multigpu.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
SBATCH = RECIPES / "slurm.sbatch"

# What a stub records for each call: argv (NUL-separated), environment (env -0), working directory.
STUB = """#!/bin/sh
f="$STUB_LOG/$(basename "$0").${SLURM_NODEID:-x}.$$"
printf '%s\\0' "$@" > "$f.argv"
env -0 > "$f.env"
pwd > "$f.cwd"
"""
# scontrol: only `scontrol show hostnames "$SLURM_JOB_NODELIST"`, answered from FAKE_HOSTNAMES.
SCONTROL = STUB + """[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] || { echo "unexpected: $*" >&2; exit 1; }
printf '%s\\n' $FAKE_HOSTNAMES
"""
# srun: one task per node, as --ntasks-per-node=1 asks: runs the command once per node with that
# node's SLURM_NODEID (its own options, all written --name=value, are recorded and skipped).
SRUN = STUB + """while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
node=0
while [ "$node" -lt "$SLURM_NNODES" ]; do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" || exit $?
    node=$((node + 1))
done
"""


@pytest.fixture
def gpu_cluster_limits(monkeypatch):
    """Validate as a GPU cluster would: no CPU-machine cap on the number of processes."""
    monkeypatch.setattr(multigpu.config, "max_cpu_workers", lambda: 64)


class Stubs:
    """A folder of stub commands, put first on PATH, and what each call recorded."""

    def __init__(self, tmp_path: Path, names: list[str]):
        self.bin, self.log = tmp_path / "stub-bin", tmp_path / "stub-log"
        self.bin.mkdir()
        self.log.mkdir()
        for name in names:
            body = {"srun": SRUN, "scontrol": SCONTROL}.get(name, STUB)
            (self.bin / name).write_text(body)
            (self.bin / name).chmod(stat.S_IRWXU)

    def run(self, script: Path, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
        full = {"PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(self.log.parent),
                "STUB_LOG": str(self.log), **env}
        return subprocess.run(["bash", str(script)], env=full, cwd=cwd, capture_output=True, text=True, timeout=60)

    def calls(self, name: str) -> list[dict]:
        """[{argv, env, cwd, node}] for every call of `name`, in node order."""
        found = []
        for argv_file in sorted(self.log.glob(f"{name}.*.argv")):
            stem = str(argv_file)[: -len(".argv")]
            env = dict(item.split("=", 1) for item in Path(stem + ".env").read_text().split("\0") if "=" in item)
            found.append({"argv": argv_file.read_text().split("\0")[:-1], "env": env,
                          "cwd": Path(Path(stem + ".cwd").read_text().strip()), "node": env.get("SLURM_NODEID")})
        return sorted(found, key=lambda call: call["node"] or "")


def parse_worker_args(argv: list[str], monkeypatch) -> argparse.Namespace:
    """multigpu.worker's own parser on argv: its main() with run_worker replaced (nothing starts)
    and the namespace its parser returned recorded on the way."""
    import multigpu.worker as worker

    parsed, original = [], argparse.ArgumentParser.parse_args

    def recording(self, *args, **kwargs):
        namespace = original(self, *args, **kwargs)
        parsed.append(namespace)
        return namespace

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording)
    monkeypatch.setattr(worker, "run_worker", lambda out, body: None)
    worker.main(argv)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    assert len(parsed) == 1, "multigpu.worker.main should parse its arguments once"
    return parsed[0]


def torchrun_launch_config(argv: list[str], monkeypatch):
    """torchrun's own parser and the LaunchConfig it would run: (args, config, cmd, cmd_args)."""
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else config_from_args sets it in this process
    args = get_args_parser().parse_args(argv)
    config, cmd, cmd_args = config_from_args(args)
    return args, config, cmd, cmd_args


def load_run_config(path: Path) -> RunConfig:
    return RunConfig.from_dict(json.loads(path.read_text())).validate()


# -- Slurm ------------------------------------------------------------------------------------

# The sbatch options the recipe uses, each an option of sbatch(1) (https://slurm.schedmd.com/sbatch.html);
# sbatch itself is not installed here, so the list is kept by hand and nothing else may appear.
SBATCH_OPTIONS = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output",
                  "partition", "account"}
FAKE_SLURM = {"SLURM_JOB_NODELIST": "gpu-[01-02]", "FAKE_HOSTNAMES": "gpu-01 gpu-02", "SLURM_NNODES": "2",
              "SLURM_JOB_ID": "12345", "SLURM_CPUS_PER_TASK": "64"}


def sbatch_directives() -> tuple[dict[str, str], set[str]]:
    """({option: value} of the active #SBATCH lines, options of the switched-off ##SBATCH lines);
    fails on a directive after the first command, where sbatch no longer reads them."""
    active, off, commands_started = {}, set(), False
    for number, line in enumerate(SBATCH.read_text().splitlines(), 1):
        if line.startswith(("#SBATCH", "##SBATCH")):
            match = re.fullmatch(r"#{1,2}SBATCH --([a-z-]+)=(\S+)", line)
            assert match, f"slurm.sbatch:{number}: not of the form #SBATCH --option=value: {line!r}"
            assert not commands_started, f"slurm.sbatch:{number}: sbatch ignores #SBATCH after the first command"
            name, value = match.groups()
            if line.startswith("##"):
                off.add(name)
            else:
                assert name not in active, f"slurm.sbatch:{number}: --{name} given twice"
                active[name] = value
        elif line.strip() and not line.startswith("#"):
            commands_started = True
    return active, off


def test_slurm_sbatch_options_are_known_and_ask_for_two_nodes_of_eight_gpus():
    active, off = sbatch_directives()
    unknown = (set(active) | off) - SBATCH_OPTIONS
    assert not unknown, f"options not in the checked list of sbatch options: {sorted(unknown)}"
    assert {k: active.get(k) for k in ("nodes", "ntasks-per-node", "gpus-per-node")} == {
        "nodes": "2", "ntasks-per-node": "1", "gpus-per-node": "8"}
    assert {"cpus-per-task", "time", "output"} <= set(active)
    assert int(active["cpus-per-task"]) >= 8, "one task per node starts 8 workers: give it their cores"
    assert re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", active["time"]), active["time"]
    assert "/" not in active["output"], "sbatch does not create a missing log folder; keep the log in the submit dir"


def test_slurm_sbatch_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def submit_dir(tmp_path) -> Path:
    """A submit directory like the repository root (its recipes/), so a run writes only in tmp."""
    (tmp_path / "submit").mkdir()
    (tmp_path / "submit" / "recipes").symlink_to(RECIPES)
    return tmp_path / "submit"


def test_slurm_multigpu_command_on_each_node_parses_with_the_package_cli(
        tmp_path, submit_dir, monkeypatch, gpu_cluster_limits):
    from multigpu.__main__ import _config, build_parser
    from multigpu.launch import check_nodes

    stubs = Stubs(tmp_path, ["srun", "scontrol", "python", "torchrun"])
    result = stubs.run(SBATCH, {**FAKE_SLURM, "SLURM_SUBMIT_DIR": str(submit_dir)})
    assert result.returncode == 0, result.stderr
    (srun,) = stubs.calls("srun")
    assert "--ntasks-per-node=1" in srun["argv"]
    assert srun["env"]["SRUN_CPUS_PER_TASK"] == "64", "srun (Slurm >= 22.05) does not inherit --cpus-per-task"
    assert not stubs.calls("torchrun")
    calls = stubs.calls("python")
    assert [c["node"] for c in calls] == ["0", "1"], "one multigpu command per node"
    expected = load_run_config(RECIPES / "slurm-run.json")
    for call in calls:
        argv = call["argv"]
        assert argv[:2] == ["-m", "multigpu"], argv
        args = build_parser().parse_args(argv[2:])
        assert args.command == "run"
        assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == (2, int(call["node"]), "gpu-01:29500")
        assert args.port is None, "one machine's --port and many nodes' --rdzv-endpoint do not mix"
        cfg = _config(args)
        # the torchrun alternative runs slurm-run.json: the same run as this command line
        assert cfg == expected, f"slurm-run.json differs from the multigpu command line: {cfg} != {expected}"
        assert cfg.device == "cuda" and cfg.degrees == {"dp": 2, "pp": 1, "tp": 8}
        assert check_nodes(cfg, args.nnodes, args.node_rank, args.rdzv_endpoint, args.port) == 8  # per node


def test_slurm_torchrun_alternative_parses_with_torchrun_and_the_worker(
        tmp_path, submit_dir, monkeypatch, gpu_cluster_limits):
    stubs = Stubs(tmp_path, ["srun", "scontrol", "python", "torchrun"])
    result = stubs.run(SBATCH, {**FAKE_SLURM, "SLURM_SUBMIT_DIR": str(submit_dir), "LAUNCHER": "torchrun"})
    assert result.returncode == 0, result.stderr
    assert not stubs.calls("python")
    calls = stubs.calls("torchrun")
    assert [c["node"] for c in calls] == ["0", "1"], "one torchrun per node"
    outs = set()
    for call in calls:
        args, config, cmd, cmd_args = torchrun_launch_config(call["argv"], monkeypatch)
        assert (args.nnodes, args.nproc_per_node) == ("2", "8")
        assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "gpu-01:29500", "12345")
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
        assert cmd == sys.executable and cmd_args[:3] == ["-u", "-m", "multigpu.worker"], cmd_args
        worker = parse_worker_args(cmd_args[3:], monkeypatch)
        assert worker.device == "cuda"
        cfg = load_run_config(call["cwd"] / worker.config)
        assert cfg.world_size == config.max_nodes * config.nproc_per_node
        out = call["cwd"] / worker.out
        assert out.is_dir(), "each node's task creates its --out before torchrun starts the workers"
        outs.add(out)
    assert len(outs) == 2, "each node writes its own folder (every node's first worker writes record.json)"


def test_slurm_rejects_an_unknown_launcher(tmp_path, submit_dir):
    stubs = Stubs(tmp_path, ["srun", "scontrol", "python", "torchrun"])
    result = stubs.run(SBATCH, {**FAKE_SLURM, "SLURM_SUBMIT_DIR": str(submit_dir), "LAUNCHER": "mpirun"})
    assert result.returncode == 2 and "LAUNCHER must be" in result.stderr
    assert not stubs.calls("srun")


# -- DeepSpeed --------------------------------------------------------------------------------

DEEPSPEED = RECIPES / "deepspeed"


def test_deepspeed_hostfile_parses_with_deepspeed_into_two_hosts_of_eight_slots():
    from deepspeed.launcher.runner import fetch_hostfile

    pool = fetch_hostfile(str(DEEPSPEED / "hostfile"))
    assert pool is not None, "DeepSpeed did not find the hostfile"
    assert dict(pool) == {"node1": 8, "node2": 8}


def test_deepspeed_env_file_has_only_lines_deepspeed_can_split():
    # runner.main reads each line as `key, val = line.split('=', maxsplit=1)`: no comments, no blanks
    for line in (DEEPSPEED / "deepspeed_env").read_text().splitlines(keepends=True):
        key, value = line.split("=", maxsplit=1)
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key) and value.strip(), repr(line)


def test_deepspeed_run_json_validates(gpu_cluster_limits):
    cfg = load_run_config(DEEPSPEED / "run.json")
    assert cfg.strategy.startswith("deepspeed-") and cfg.world_size == 16 and cfg.device == "cuda"


def test_deepspeed_launch_parses_with_deepspeed_down_to_each_worker(tmp_path, monkeypatch, gpu_cluster_limits):
    import deepspeed.launcher.launch as ds_launch
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import (
        apply_num_nodes_and_gpus,
        encode_world_info,
        fetch_hostfile,
        parse_args,
        parse_inclusion_exclusion,
    )

    stubs = Stubs(tmp_path, ["deepspeed"])
    result = stubs.run(DEEPSPEED / "launch.sh", {"OUT": str(tmp_path / "out")})
    assert result.returncode == 0, result.stderr
    (call,) = stubs.calls("deepspeed")
    assert call["cwd"] == ROOT, "launch.sh runs from the repository root (pdsh cds to the same path on each node)"
    monkeypatch.chdir(call["cwd"])
    args = parse_args(call["argv"])
    assert (args.num_nodes, args.num_gpus, args.master_addr, args.master_port) == (2, 8, "node1", 29500)
    assert args.module and args.no_local_rank and args.user_script == "multigpu.worker"
    assert args.launcher == "pdsh"

    # what runner.main does next, with DeepSpeed's own functions: the hosts and GPUs it uses
    active = parse_inclusion_exclusion(fetch_hostfile(args.hostfile), args.include, args.exclude)
    active = apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    assert dict(active) == {"node1": list(range(8)), "node2": list(range(8))}
    runner = PDSHRunner(args, encode_world_info(active))
    with open(call["env"]["DS_ENV_FILE"]) as fd:  # as runner.main reads the DS_ENV_FILE
        for line in fd.readlines():
            key, val = line.split("=", maxsplit=1)
            runner.add_export(key, val)
    cmd, _, _ = runner.get_cmd(dict(call["env"]), active)
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node1,node2"], cmd
    exports = cmd[6]
    for name in ("TMPDIR", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME"):
        assert f"export {name}=" in exports, f"{name} does not reach the other nodes"

    # the command pdsh runs on each node (pdsh puts the node's rank for %n): DeepSpeed's per-node
    # launcher, parsed by its own parser
    node_argv = cmd[cmd.index("deepspeed.launcher.launch") + 1:]
    assert "--node_rank=%n" in node_argv
    for node in (0, 1):
        argv = [f"--node_rank={node}" if arg == "--node_rank=%n" else arg for arg in node_argv]
        monkeypatch.setattr(sys, "argv", ["deepspeed.launcher.launch", *argv])
        node_args = ds_launch.parse_args()
        assert node_args.node_rank == node
        assert node_args.module and node_args.no_local_rank, "without --no_local_rank the worker gets --local_rank=N"
        assert (node_args.master_addr, node_args.master_port) == ("node1", 29500)
        assert node_args.training_script == "multigpu.worker"
        world = json.loads(base64.urlsafe_b64decode(node_args.world_info))
        assert list(world) == ["node1", "node2"]
        worker = parse_worker_args(node_args.training_script_args, monkeypatch)
        assert worker.device == "cuda" and worker.out == tmp_path / "out" and worker.out.is_dir()
        cfg = load_run_config(ROOT / worker.config)
        assert cfg.world_size == sum(len(gpus) for gpus in world.values()) == 16


# -- Accelerate -------------------------------------------------------------------------------

ACCELERATE = RECIPES / "accelerate"


def test_accelerate_config_loads_with_accelerate():
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    raw = yaml.safe_load((ACCELERATE / "config.yaml").read_text())
    assert raw["mixed_precision"] == "no", "unquoted, YAML reads no as False"
    config = load_config_from_file(str(ACCELERATE / "config.yaml"))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert (config.num_machines, config.num_processes, config.main_process_port) == (2, 16, 29500)
    assert (config.rdzv_backend, config.same_network) == ("c10d", False)


def test_accelerate_launch_parses_with_accelerate_down_to_torchrun_and_the_worker(
        tmp_path, monkeypatch, gpu_cluster_limits):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import _filter_args, prepare_multi_gpu_env
    from torch.distributed.run import config_from_args, get_args_parser

    stubs = Stubs(tmp_path, ["accelerate"])
    # machine 1: accelerate checks that the port is free only on machine 0, this one's own
    result = stubs.run(ACCELERATE / "launch.sh", {"OUT": str(tmp_path / "out"), "MACHINE_RANK": "1"})
    assert result.returncode == 0, result.stderr
    (call,) = stubs.calls("accelerate")
    assert call["argv"][0] == "launch"
    monkeypatch.chdir(call["cwd"])
    args = launch_command_parser().parse_args(call["argv"][1:])
    assert args.module and args.training_script == "multigpu.worker" and args.machine_rank == 1
    # accelerate 1.15.0 takes rdzv_backend from the command line only (its default, static, is not
    # empty, so the config file's value never replaces it): the command must say what the file says
    assert args.rdzv_backend == yaml.safe_load((ACCELERATE / "config.yaml").read_text())["rdzv_backend"]

    # what `accelerate launch` does with them on a multi-GPU config (its multi_gpu_launcher)
    args, _, _ = _validate_launch_command(args)
    assert args.multi_gpu and (args.num_machines, args.num_processes) == (2, 16)
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    torchrun_args = _filter_args(args, get_args_parser(), ["--training_script", args.training_script,
                                                          "--training_script_args", args.training_script_args])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config, cmd, cmd_args = config_from_args(torchrun_args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "10.0.0.1:29500")
    assert cmd_args[:3] == ["-u", "-m", "multigpu.worker"], cmd_args
    worker = parse_worker_args(cmd_args[3:], monkeypatch)
    assert worker.device == "cuda" and worker.out == tmp_path / "out" / "machine1" and worker.out.is_dir()
    assert load_run_config(ROOT / worker.config).world_size == args.num_processes


def test_accelerate_launch_needs_the_machine_rank(tmp_path):
    stubs = Stubs(tmp_path, ["accelerate"])
    result = stubs.run(ACCELERATE / "launch.sh", {"OUT": str(tmp_path / "out")})
    assert result.returncode != 0 and "MACHINE_RANK" in result.stderr
    assert not stubs.calls("accelerate")


# -- the managed-cluster recipe and the index -------------------------------------------------


@pytest.mark.parametrize("topic", [
    "container image", "deepspeed", "mpi", "ssh", "master address", "port", "shared storage", "tmpdir",
    "non-root", "hf_home", "triton_cache_dir", "torch_extensions_dir", "xdg_cache_home", "nccl",
    "python -m multigpu check", "all_reduce_perf", "one node",
])
def test_managed_cluster_recipe_covers(topic):
    assert topic in (RECIPES / "managed-cluster.md").read_text().lower()


def test_readme_names_every_recipe_file():
    readme = (RECIPES / "README.md").read_text()
    files = [p.relative_to(RECIPES).as_posix() for p in RECIPES.rglob("*") if p.is_file() and p.name != "README.md"]
    missing = [f for f in files if f not in readme]
    assert not missing, f"recipes/README.md does not mention: {missing}"
