"""Writes the rlhf example's preference pairs and KTO rows from the sft example's questions.

  python examples/rlhf/make_preferences.py OUT

OUT/prefs.jsonl     one row per question in TRL's standard form: the prompt as the plain
                    template renders a question, the right answer chosen, a wrong one
                    rejected.
OUT/feedback.jsonl  the same answers unpaired for KTO, in TRL's prompt/completion/label form:
                    each question's right answer labelled true, the wrong one false.
"""

import json
import os
import sys


def main(out: str) -> None:
    with open(os.path.join(out, "questions.json"), encoding="utf-8") as fh:
        questions = json.load(fh)
    answers = [q["answer"] for q in questions]
    pairs, feedback = [], []
    for i, q in enumerate(questions):
        wrong = next(a for a in answers[i + 1:] + answers[:i] if a != q["answer"])
        prompt = f"### User:\n{q['question']}\n\n### Assistant:\n"
        pairs.append({"prompt": prompt, "chosen": q["answer"], "rejected": wrong})
        feedback.append({"prompt": prompt, "completion": q["answer"], "label": True})
        feedback.append({"prompt": prompt, "completion": wrong, "label": False})
    for name, rows in (("prefs.jsonl", pairs), ("feedback.jsonl", feedback)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(pairs)} preference pairs to {out}/prefs.jsonl and {len(feedback)} "
          f"labelled answers to {out}/feedback.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "output/rlhf-example")
