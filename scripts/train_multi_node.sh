#!/usr/bin/env bash
# Several machines. Run this same script on every node, changing only NODE_RANK:
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/train_multi_node.sh
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/train_multi_node.sh
# Every node needs the same code, the same data paths and a shared (or identical) output
# directory for checkpoints; MASTER_ADDR is node 0's address, reachable from all nodes.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES="${NNODES:-2}"                   # machines in the job
NODE_RANK="${NODE_RANK:?set NODE_RANK (0 on the master node, 1..NNODES-1 elsewhere)}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"   # ranks per machine (GPUs per node)
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to node 0\'s address}"
MASTER_PORT="${MASTER_PORT:-29500}"     # a free TCP port on node 0
OUTPUT_DIR="${OUTPUT_DIR:-output/multi-node}"   # put this on a shared file system

exec .venv/bin/torchrun \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m swift_mcore pt --output_dir "$OUTPUT_DIR" "$@"

# The same with swift-mcore's own launcher (ms-swift's convention):
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
#     swift-mcore pt --output_dir output/multi-node ...
