#!/usr/bin/env bash
# End to end: finetune a tiny random Hugging Face Llama on a small instruction set until it
# reproduces the answers, export it to a Hugging Face folder, and ask it with `infer`.
#
#   bash examples/sft/run.sh [OUT]          (about a minute on 2 CPU cores)
#
# Run from the repository root after `bash scripts/setup.sh` (or with swift-mcore installed).
set -euo pipefail
OUT=${1:-output/sft-example}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
rm -rf "$OUT/run"

# 1. The starting point: a random LlamaForCausalLM from a config + a tokenizer, and the data.
"$PY" examples/sft/make_tiny_model_and_data.py "$OUT"

# 2. Finetune: loss on the answers only, 40 passes over 24 conversations (120 steps);
#    --save_safetensors writes each checkpoint (here only the final one) as a Hugging Face
#    folder too.
"$PY" -m swift_mcore sft --model "$OUT/base-model" --dataset "$OUT/train.jsonl" \
    --template plain --seq_length 64 --micro_batch_size 4 --global_batch_size 8 \
    --lr 3e-3 --lr_warmup_iters 5 --num_train_epochs 40 --log_interval 20 \
    --progress_bar false --output_dir "$OUT/run" --save_safetensors

HF=$(ls -d "$OUT"/run/checkpoint/iter_*-hf | tail -n 1)

# 3. Ask it, as a user would: the question is rendered with the same template.
"$PY" -m swift_mcore infer --model "$HF" --template plain \
    --prompt "Which planet does Ada live on?"

# 4. Every question, asked of the exported folder in transformers (its chat template is the
#    training template) and checked against its answer (exit 1 unless all are right).
"$PY" examples/sft/check_answers.py "$HF" "$OUT/questions.json"
