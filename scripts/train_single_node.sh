#!/usr/bin/env bash
# One machine, several ranks. Adapt the variables below, then: bash scripts/train_single_node.sh
# On GPUs: one rank per GPU, NCCL is picked automatically. On CPU: gloo, one rank per core
# or two is a sensible upper bound.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC_PER_NODE="${NPROC_PER_NODE:-2}"   # ranks on this machine (GPUs on a GPU node)
TP="${TP:-1}"                           # tensor-parallel size (must divide heads)
PP="${PP:-1}"                           # pipeline stages (must divide num_layers)
OUTPUT_DIR="${OUTPUT_DIR:-output/single-node}"

# torchrun starts NPROC_PER_NODE copies of `python -m swift_mcore pt`; data-parallel size is
# NPROC_PER_NODE / (TP * PP) and the global batch is split across those replicas.
exec .venv/bin/torchrun --standalone --nproc_per_node "$NPROC_PER_NODE" -m swift_mcore pt \
  --tensor_model_parallel_size "$TP" \
  --pipeline_model_parallel_size "$PP" \
  --output_dir "$OUTPUT_DIR" \
  "$@"
