#!/usr/bin/env bash
# DeepSpeed's launcher: one multigpu run (recipes/deepspeed/run.json: DeepSpeed ZeRO-3, gpt2,
# 16 processes) on 2 nodes x 8 GPUs, started by one command on the first node.
#
#     bash recipes/deepspeed/launch.sh            (on node1, the hostfile's first host)
#
# What the launcher does (deepspeed/launcher/runner.py and multinode_runner.py, DeepSpeed 0.19.8):
# it reads the hostfile, checks `ssh -o PasswordAuthentication=no <first host> hostname`, then
# uses pdsh to run on every host `cd <this repository>; <this python> -m deepspeed.launcher.launch
# ...`, which starts one process per GPU with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT set: what multigpu.worker reads. So every node needs passwordless SSH from node1,
# pdsh installed on node1, and this repository and this python at the same paths (shared storage,
# or the same container image). Only variables whose names start with NCCL, PYTHON, UCX, MV2 or
# MLFLOW travel to the other nodes, plus the lines of the file DS_ENV_FILE names (see below).
#
# ADAPT:
#   - recipes/deepspeed/hostfile: your nodes' names and GPUs (slots);
#   - MASTER_ADDR: node1's address as the other nodes reach it; MASTER_PORT: free on node1;
#   - --num_nodes / --num_gpus below, and world_size in run.json (= nodes x GPUs per node);
#   - recipes/deepspeed/deepspeed_env: cache and temp folders on each node's local disk. The
#     file takes only KEY=VALUE lines (DeepSpeed splits every line at its first '='; a comment or
#     a blank line makes the launcher fail), and the folders must exist on every node: a missing TMPDIR
#     makes Python fall back to /tmp without a word (pdsh -w node1,node2 mkdir -p <folder>);
#   - OUT: on storage every node sees. It is created here, on node1 only, and every worker
#     writes into it (each node's first worker writes the record).
# Checked here by tests/test_recipes.py (the hostfile with DeepSpeed's own parser; this command
# with DeepSpeed's parser and its pdsh runner, down to each worker's arguments); never run on
# real nodes.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: pdsh runs `cd` to this same path on every node

MASTER_ADDR=${MASTER_ADDR:-node1}  # ADAPT
MASTER_PORT=${MASTER_PORT:-29500}  # ADAPT
OUT=${OUT:-runs/deepspeed-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# PYTHON* variables travel to every node, so the workers find the package in src/
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# KEY=VALUE lines DeepSpeed exports on every node before it starts the workers
export DS_ENV_FILE="$PWD/recipes/deepspeed/deepspeed_env"
# ADAPT, NCCL (these travel to every node): NCCL_DEBUG=INFO for first runs; NCCL_SOCKET_IFNAME
# when NCCL picks an interface that does not connect the nodes
# export NCCL_DEBUG=INFO
# export NCCL_SOCKET_IFNAME=ib0

# --module: run multigpu.worker as `python -m`; --no_local_rank: DeepSpeed would otherwise add
# --local_rank=N to the worker's arguments, which multigpu.worker does not take (it reads
# LOCAL_RANK from the environment). Everything after the module name is the worker's.
deepspeed --hostfile recipes/deepspeed/hostfile --num_nodes 2 --num_gpus 8 \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --no_local_rank --module multigpu.worker \
    --config recipes/deepspeed/run.json --out "$OUT" --device cuda
