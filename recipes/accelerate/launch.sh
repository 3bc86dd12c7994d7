#!/usr/bin/env bash
# Hugging Face Accelerate: one multigpu run (recipes/accelerate/run.json: DDP, gpt2, 16 processes)
# on 2 machines x 8 GPUs. Run it on every machine, each with its own rank, machine 0 first:
#
#     MACHINE_RANK=0 bash recipes/accelerate/launch.sh     (on the machine main_process_ip names)
#     MACHINE_RANK=1 bash recipes/accelerate/launch.sh     (on the other)
#
# accelerate launch reads config.yaml and starts torchrun on this machine (--nnodes 2
# --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint main_process_ip:main_process_port);
# torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for multigpu.worker.
# -m (--module): run multigpu.worker as `python -m`; everything after its name is the worker's.
#
# ADAPT: config.yaml (address, port, machines, processes); OUT. Each machine writes its own
# folder under OUT (each machine's first worker writes the record).
# Checked here by tests/test_recipes.py (config.yaml with accelerate's own loader; this command
# with accelerate's parser, down to the torchrun configuration and the worker's arguments); never
# run on real machines.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: the recipes/ paths are relative to it

MACHINE_RANK=${MACHINE_RANK:?set MACHINE_RANK: 0 on the machine main_process_ip names, 1 on the other}
OUT=${OUT:-runs/accelerate}
mkdir -p "$OUT/machine$MACHINE_RANK"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# ADAPT, NCCL: NCCL_DEBUG=INFO for first runs; NCCL_SOCKET_IFNAME when NCCL picks an interface
# that does not connect the machines
# export NCCL_DEBUG=INFO
# export NCCL_SOCKET_IFNAME=ib0

# --rdzv_backend c10d here, not only in config.yaml: accelerate 1.15.0 ignores the file's value
# (its command-line default, static, wins); static would still work, with fixed node ranks.
accelerate launch --config_file recipes/accelerate/config.yaml --machine_rank "$MACHINE_RANK" --rdzv_backend c10d \
    -m multigpu.worker --config recipes/accelerate/run.json --out "$OUT/machine$MACHINE_RANK" --device cuda
