"""Asks a finetuned Hugging Face folder every question of the example and counts the answers
it reproduces exactly (greedy decoding, the same template as training).

  python examples/sft/check_answers.py HF_FOLDER QUESTIONS_JSON [--template plain]
Exits 1 unless every answer is reproduced.
"""

import argparse
import contextlib
import io
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("questions")
    parser.add_argument("--template", default="plain")
    opts = parser.parse_args()

    from swift_mcore._quiet import quiet_third_party
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    quiet_third_party()
    with open(opts.questions, encoding="utf-8") as fh:
        questions = json.load(fh)
    right = 0
    for item in questions:
        args = InferArguments(model=opts.model, prompt=item["question"],
                              template=opts.template, max_new_tokens=24).validate()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            answer = run(args)
        ok = answer.strip() == item["answer"]
        right += ok
        print(f"{'ok ' if ok else 'BAD'} {item['question']} -> {answer.strip()!r}"
              + ("" if ok else f" (expected {item['answer']!r})"))
    print(f"{right}/{len(questions)} answers reproduced")
    return 0 if right == len(questions) else 1


if __name__ == "__main__":
    sys.exit(main())
