"""Writes the DPO example's preference pairs from the sft example's questions.

  python examples/rlhf/make_preferences.py OUT

OUT/prefs.jsonl  one row per question in TRL's standard form: the prompt as the plain
                 template renders a question, the right answer chosen, a wrong one rejected.
"""

import json
import os
import sys


def main(out: str) -> None:
    with open(os.path.join(out, "questions.json"), encoding="utf-8") as fh:
        questions = json.load(fh)
    answers = [q["answer"] for q in questions]
    with open(os.path.join(out, "prefs.jsonl"), "w", encoding="utf-8") as fh:
        for i, q in enumerate(questions):
            wrong = next(a for a in answers[i + 1:] + answers[:i] if a != q["answer"])
            fh.write(json.dumps({"prompt": f"### User:\n{q['question']}\n\n### Assistant:\n",
                                 "chosen": q["answer"], "rejected": wrong}) + "\n")
    print(f"wrote {len(questions)} preference pairs to {out}/prefs.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "output/rlhf-example")
