"""Asks the exported Hugging Face folder every question of the example in transformers, as a
user of the folder would, and counts the answers it reproduces exactly (greedy decoding; the
prompt is rendered by the chat template the export wrote, the training template).

  python examples/sft/check_answers.py HF_FOLDER QUESTIONS_JSON
Exits 1 unless every answer is reproduced.
"""

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("questions")
    opts = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with open(opts.questions, encoding="utf-8") as fh:
        questions = json.load(fh)
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model = AutoModelForCausalLM.from_pretrained(opts.model).eval()  # loaded once for all
    right = 0
    for item in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": item["question"]}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        ok = answer == item["answer"]
        right += ok
        print(f"{'ok ' if ok else 'BAD'} {item['question']} -> {answer!r}"
              + ("" if ok else f" (expected {item['answer']!r})"))
    print(f"{right}/{len(questions)} answers reproduced")
    return 0 if right == len(questions) else 1


if __name__ == "__main__":
    sys.exit(main())
