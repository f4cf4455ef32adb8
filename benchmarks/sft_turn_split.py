"""Cost of training reasoning models' multi-turn rows per turn: tokens and encoding time.

    .venv/bin/python benchmarks/sft_turn_split.py --rows 200 --turns 2 4 8

A Qwen3-style template (tests/sft/chat_templates.py: earlier turns' reasoning dropped once
the user speaks again) splits a row of K user turns into K samples, each after the history
the model sees at inference for it (docs/sft.md, "Reasoning models"). For --rows random rows
of K turns (20-word user messages, 40-word answers with 40 words of reasoning), measured in
this process: the tokens of all samples against the tokens of rendering each row once
(`apply_chat_template` of the whole row: what training it as one text would cost), the
trained tokens, and the encoding time per row against the built-in chatml template on the
same rows without reasoning (the baseline, measured in the same run). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bench_common import on_path  # puts the checkout on sys.path

on_path("tests", "sft")

WORDS = "alpha beta gamma delta river stone cloud paper orange silver seven north".split()


def rows(count: int, turns: int, seed: int = 0):
    from swift_mcore.data.conversations import Conversation

    rng = random.Random(seed)

    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    out = []
    for _ in range(count):
        messages = []
        for _ in range(turns):
            messages += [{"role": "user", "content": text(20)},
                         {"role": "assistant", "content": text(40),
                          "reasoning_content": text(40)}]
        out.append(Conversation(messages))
    return out


def measure(count: int, turns: int) -> dict:
    from chat_templates import qwen3
    from swift_mcore.data.conversations import Conversation
    from swift_mcore.data.sft_datasets import encode_conversations
    from swift_mcore.data.templates import Template

    tokenizer = qwen3()
    data = rows(count, turns)
    start = time.perf_counter()
    split = encode_conversations(data, Template("tokenizer", tokenizer), 10**6, "drop",
                                 "all_turns")
    split_s = time.perf_counter() - start
    whole = sum(len(ids) for ids in tokenizer.encode_batch(
        [tokenizer.hf.apply_chat_template(c.messages, tokenize=False) for c in data]))
    plain = [Conversation([{k: v for k, v in m.items() if k != "reasoning_content"}
                           for m in c.messages]) for c in data]
    start = time.perf_counter()
    encode_conversations(plain, Template("chatml", tokenizer), 10**6, "drop", "all_turns")
    chatml_s = time.perf_counter() - start
    return {"turns": turns, "rows": count, "samples": len(split),
            "tokens": int(len(split.ids)), "tokens_whole_render": whole,
            "token_ratio": round(len(split.ids) / whole, 3),
            "trained_tokens": int(split.targets.sum()),
            "ms_per_row": round(1000 * split_s / count, 2),
            "chatml_ms_per_row": round(1000 * chatml_s / count, 2),
            "time_ratio_vs_chatml": round(split_s / chatml_s, 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    result = {"cases": [measure(args.rows, k) for k in args.turns]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
