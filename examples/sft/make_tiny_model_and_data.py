"""Writes what the sft example starts from: a tiny random Llama and a small instruction set.

  python examples/sft/make_tiny_model_and_data.py OUT

OUT/base-model   a Hugging Face folder: LlamaForCausalLM from a config (random weights) and
                 swift-mcore's built-in tokenizer, as a user's own model would be.
OUT/train.jsonl  24 questions in the `messages` form, each with an answer no model could
                 guess: the finetuned model reproduces them only if it learned them.
OUT/questions.json  the questions and their answers, to check the finetuned model.
"""

import json
import os
import random
import sys

NAMES = ["Ada", "Bram", "Cleo", "Dov", "Esme", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai",
         "Lena"]
PLANETS = ["Mars", "Venus", "Saturn", "Jupiter", "Neptune", "Mercury"]
COLOURS = ["red", "blue", "green", "orange", "purple", "yellow"]


def instruction_set(seed: int = 0):
    rng = random.Random(seed)
    pairs = []
    for name in NAMES:
        pairs.append((f"Which planet does {name} live on?", rng.choice(PLANETS)))
        pairs.append((f"What colour is {name}'s boat?", f"{name}'s boat is {rng.choice(COLOURS)}."))
    return pairs


def main(out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from swift_mcore.data import default_tokenizer

    os.makedirs(out, exist_ok=True)
    tokenizer = default_tokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eod, bos_token_id=tokenizer.eod, pad_token_id=tokenizer.pad)
    torch.manual_seed(0)
    folder = os.path.join(out, "base-model")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    pairs = instruction_set()
    with open(os.path.join(out, "train.jsonl"), "w", encoding="utf-8") as fh:
        for question, answer in pairs:
            fh.write(json.dumps({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]}) + "\n")
    with open(os.path.join(out, "questions.json"), "w", encoding="utf-8") as fh:
        json.dump([{"question": q, "answer": a} for q, a in pairs], fh, indent=1)
    print(f"wrote {folder} and {len(pairs)} conversations to {out}/train.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "output/sft-example")
