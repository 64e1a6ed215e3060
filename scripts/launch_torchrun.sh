#!/usr/bin/env bash
# Multi-node training under torchrun: run this once on every node, the same arguments but the node rank.
#   scripts/launch_torchrun.sh NODES NODE_RANK MASTER_ADDR MASTER_PORT DEVICES hydra.run.dir=/shared/runs/x [overrides...]
#     NODES        nodes in the job (trainer.num_nodes)
#     NODE_RANK    this node: 0 on the node at MASTER_ADDR, 1 .. NODES-1 on the others
#     MASTER_ADDR  node 0's address, reachable from every node; MASTER_PORT a free port there (the same on all nodes)
#     DEVICES      processes on this node, one per GPU (trainer.devices, torchrun --nproc-per-node)
#     then Hydra overrides; hydra.run.dir is required: one folder on a filesystem every node sees.
# trainer=ddp unless the overrides pick another trainer (on GPUs add trainer.precision=bf16-mixed). PYTHON (default:
# python on PATH) must be the project's venv, the same path on every node. Details: docs/multinode.md.
#   node 0:  scripts/launch_torchrun.sh 2 0 10.0.0.1 29500 8 hydra.run.dir=/shared/runs/a model=qwen2.5-7b
#   node 1:  scripts/launch_torchrun.sh 2 1 10.0.0.1 29500 8 hydra.run.dir=/shared/runs/a model=qwen2.5-7b
set -euo pipefail
if [ $# -lt 5 ]; then
  sed -n '2,7p' "$0" >&2
  exit 2
fi
nodes=$1 node_rank=$2 addr=$3 port=$4 devices=$5
shift 5
for n in "$nodes" "$node_rank" "$port" "$devices"; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "launch_torchrun.sh: '$n' is not a number (NODES NODE_RANK MASTER_ADDR MASTER_PORT DEVICES)" >&2; exit 2; }
done
if [ "$node_rank" -ge "$nodes" ]; then
  echo "launch_torchrun.sh: NODE_RANK=$node_rank must be below NODES=$nodes" >&2; exit 2
fi
overrides=" $* "
if [[ $overrides != *" hydra.run.dir="* ]]; then
  echo "launch_torchrun.sh: pass hydra.run.dir=<folder on a filesystem every node sees> (each node composes its own" \
       "config: a folder named by the clock would differ between nodes)" >&2
  exit 2
fi
trainer=()
[[ $overrides == *" trainer="* ]] || trainer=(trainer=ddp)
root=$(cd "$(dirname "$0")/.." && pwd)
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes "$nodes" --nproc-per-node "$devices" --node-rank "$node_rank" \
  --master-addr "$addr" --master-port "$port" "$root/train.py" \
  "${trainer[@]}" "trainer.num_nodes=$nodes" "trainer.devices=$devices" "$@"
