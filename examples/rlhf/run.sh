#!/usr/bin/env bash
# End to end: sft a tiny random Hugging Face Llama, then DPO on preference pairs (the right
# answer chosen, a wrong one rejected), export the result and ask it with `infer`; KTO on
# the same answers labelled desirable or not, exported and asked too; then a reward model on
# the pairs, exported and scoring a right and a wrong answer.
#
#   bash examples/rlhf/run.sh [OUT]          (a few minutes on 2 CPU cores)
#
# Run from the repository root after `bash scripts/setup.sh` (or with swift-mcore installed).
set -euo pipefail
OUT=${1:-output/rlhf-example}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
rm -rf "$OUT/sft" "$OUT/dpo" "$OUT/dpo-hf" "$OUT/kto" "$OUT/kto-hf" "$OUT/rm" "$OUT/rm-hf"

# 1. The starting point (the sft example's): a random Llama, 24 questions, the pairs and
#    the labelled answers.
"$PY" examples/sft/make_tiny_model_and_data.py "$OUT"
"$PY" examples/rlhf/make_preferences.py "$OUT"

# 2. sft as examples/sft/run.sh does it, saved as a Hugging Face folder too.
"$PY" -m swift_mcore sft --model "$OUT/base-model" --dataset "$OUT/train.jsonl" \
    --template plain --seq_length 64 --micro_batch_size 4 --global_batch_size 8 \
    --lr 3e-3 --lr_warmup_iters 5 --num_train_epochs 40 --log_interval 40 --progress_bar false \
    --output_dir "$OUT/sft" --save_safetensors
SFT=$(ls -d "$OUT"/sft/checkpoint/iter_*-hf | tail -n 1)

# 3. DPO from the sft model; its reference is the sft model itself (the starting weights).
"$PY" -m swift_mcore rlhf --rlhf_type dpo --model "$SFT" --dataset "$OUT/prefs.jsonl" \
    --beta 0.1 --seq_length 64 --micro_batch_size 4 --global_batch_size 8 --lr 1e-4 \
    --num_train_epochs 3 --log_interval 3 --progress_bar false --output_dir "$OUT/dpo"

# 4. Export the last checkpoint and ask it, as a user would.
"$PY" -m swift_mcore export --to_hf --model "$OUT/dpo" --output_dir "$OUT/dpo-hf"
"$PY" -m swift_mcore infer --model "$OUT/dpo-hf" --template plain \
    --prompt "Which planet does Ada live on?"

# 5. KTO from the sft model on the answers labelled desirable (right) or not (wrong): its
#    reference is the sft model too; the log line carries TRL's KTO metrics (kl included).
"$PY" -m swift_mcore rlhf --rlhf_type kto --model "$SFT" --dataset "$OUT/feedback.jsonl" \
    --beta 0.1 --seq_length 64 --micro_batch_size 4 --global_batch_size 8 --lr 1e-4 \
    --num_train_epochs 2 --log_interval 3 --progress_bar false --output_dir "$OUT/kto"
"$PY" -m swift_mcore export --to_hf --model "$OUT/kto" --output_dir "$OUT/kto-hf"
"$PY" -m swift_mcore infer --model "$OUT/kto-hf" --template plain \
    --prompt "Which planet does Ada live on?"

# 6. A reward model from the sft model on the same pairs (a new score head on its decoder):
#    export it and score the first pair's right and wrong answer, one number each.
"$PY" -m swift_mcore rlhf --rlhf_type rm --model "$SFT" --dataset "$OUT/prefs.jsonl" \
    --seq_length 64 --micro_batch_size 4 --global_batch_size 8 --lr 1e-3 \
    --num_train_epochs 3 --log_interval 3 --progress_bar false --output_dir "$OUT/rm"
"$PY" -m swift_mcore export --to_hf --model "$OUT/rm" --output_dir "$OUT/rm-hf"
for answer in chosen rejected; do
    TEXT=$("$PY" -c "import json, sys; r = json.loads(open(sys.argv[1]).readline()); \
print(r['prompt'] + r[sys.argv[2]], end='')" "$OUT/prefs.jsonl" "$answer")
    echo "reward of the $answer answer: $("$PY" -m swift_mcore infer --model "$OUT/rm-hf" \
        --prompt "$TEXT" 2>/dev/null)"
done
