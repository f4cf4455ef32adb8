"""`swift-mcore infer`: continue a prompt with a Hugging Face folder or a swift-mcore checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List

from .arguments.infer import InferArguments
from .errors import ArgumentError

DESCRIPTION = """Generate text from a model, to see what it learned: greedy by default, or
sampled with --temperature and --top_p. Runs in one process (CPU, or one GPU when present)."""


def parse(argv: List[str]) -> InferArguments:
    from .arguments.parser import add_flags

    parser = argparse.ArgumentParser(prog="swift-mcore infer", description=DESCRIPTION,
                                     argument_default=argparse.SUPPRESS)
    add_flags(parser, InferArguments)
    return InferArguments(**vars(parser.parse_args(argv))).validate()


def run(args: InferArguments) -> str:
    """Prints the prompt and its continuation as they are generated; returns the continuation."""
    from .models.generate import generate
    from .loaded_model import forward_logits, load_model

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.image is not None:  # before the model loads
        from .data.multimodal import check_aspect
        from .input_files import check_image

        check_aspect(check_image(os.path.expanduser(args.image), f"--image {args.image}"),
                     f"--image {args.image}")
    if args.video is not None:
        from .input_files import check_video

        check_video(os.path.expanduser(args.video), f"--video {args.video}")
    loaded = load_model(args.model, tokenizer=args.tokenizer, log=log,
                        trust_remote_code=args.trust_remote_code)
    tokenizer = loaded.tokenizer
    if loaded.config.model.num_labels:
        return score(args, loaded, log)
    template, end_marker = None, ""
    logits_fn = lambda t: forward_logits(loaded.model, t)  # noqa: E731
    if args.image is not None or args.video is not None:
        from .data.multimodal import image_prompt

        sizes = {}
        if loaded.kind == "checkpoint":  # the images as it was trained on them
            from .checkpointing import read_run_flags

            saved = read_run_flags(loaded.path).get("sft") or {}
            sizes = {k: saved[k] for k in ("min_pixels", "max_pixels") if saved.get(k)}
        prompt, logits_fn, end_marker, template = image_prompt(loaded, args, sizes)
    elif args.template:
        from .data.templates import Template

        template = Template(args.template, tokenizer, system=args.system)
        prompt = template.prompt([{"role": "user", "content": args.prompt}])
        end_marker = template.end_marker()
    else:
        # as transformers would tokenize it (with the BOS token a Llama tokenizer adds)
        prompt = list(tokenizer.hf(args.prompt)["input_ids"])
    m = loaded.config.model
    check_context(len(prompt), args.max_new_tokens, m.max_position_embeddings,
                  m.position_embedding_type, log)
    # learned position embeddings end at max_position_embeddings; RoPE does not
    limit = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None
    if template is None:
        print(args.prompt, end="", flush=True)
    new: List[int] = []
    shown = printed = ""
    for token in generate(logits_fn, prompt,
                          args.max_new_tokens, loaded.vocab, eos=tokenizer.eod,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                          max_length=limit):
        new.append(token)
        text = tokenizer.decode([t for t in new if t != tokenizer.eod])
        # streamed; a templated answer is printed whole, marker cut. A character whose bytes
        # span tokens decodes as U+FFFD until its last byte comes: held back until then
        stable = text.rstrip("\ufffd")
        if template is None and stable.startswith(printed):
            print(stable[len(printed):], end="", flush=True)
            printed = stable
        shown = text
        if end_marker and end_marker in text:  # the answer is over, EOD or not
            break
    if template is None and shown.startswith(printed):
        print(shown[len(printed):], end="", flush=True)  # bytes no later token completed
    if template is not None:
        # the answer's end-of-turn marker (chatml's <|im_end|>) is not part of the answer
        answer = template.answer_text(shown)
        print(answer, flush=True)
        return answer
    print(flush=True)
    return shown


def score(args: InferArguments, loaded, log: Callable[[str], None]) -> str:
    """A reward model scores --prompt (prompt and answer as one text, the EOS appended as
    its training rows had it) instead of continuing it: prints the score, one line."""
    from .models.value_head import pad_id_of, score_sequences

    if args.template:
        raise ArgumentError(f"--template: --model {args.model} is a reward model, which "
                            f"scores text instead of answering; give the prompt and its "
                            f"answer as one --prompt")
    hf = loaded.tokenizer.hf
    text = args.prompt if args.prompt.endswith(hf.eos_token) else args.prompt + hf.eos_token
    ids = list(hf(text=text)["input_ids"])
    m = loaded.config.model
    if len(ids) > m.max_position_embeddings:
        log(f"WARNING: --prompt is {len(ids)} tokens, past max_position_embeddings "
            f"({m.max_position_embeddings}), the longest sequence this model was built for")
    pad = pad_id_of(loaded.tokenizer)
    if loaded.kind == "hf":  # transformers reads the score by config.json's pad token
        from .models.hf_folder import HFFolder

        configured = HFFolder(loaded.path, flag="--model").config.get("pad_token_id")
        pad = configured if isinstance(configured, int) else pad
    value = float(score_sequences(loaded.model, [ids], pad)[0, 0])
    line = repr(value)
    print(line, flush=True)
    return line


def check_context(prompt_tokens: int, max_new_tokens: int, context: int, positions: str,
                  log: Callable[[str], None]) -> None:
    """Refuse a prompt that leaves learned position embeddings no room for --max_new_tokens
    (generation would stop early, or print nothing); past the trained length of RoPE (or no)
    positions the model still runs, so that is a warning."""
    total = prompt_tokens + max_new_tokens
    if total <= context:
        return
    if positions == "learned_absolute":
        if prompt_tokens >= context:
            raise ArgumentError(
                f"--prompt is {prompt_tokens} tokens, but the model's learned position "
                f"embeddings end at {context} positions (max_position_embeddings): no token "
                f"can follow it; shorten the prompt")
        raise ArgumentError(
            f"--max_new_tokens {max_new_tokens}: the prompt's {prompt_tokens} tokens and "
            f"{max_new_tokens} new ones exceed the model's {context} learned positions "
            f"(max_position_embeddings); pass --max_new_tokens {context - prompt_tokens} or "
            f"less, or shorten the prompt")
    log(f"WARNING: the prompt's {prompt_tokens} tokens and up to {max_new_tokens} new ones "
        f"reach past max_position_embeddings ({context}), the longest sequence this model "
        f"was built for; the text beyond position {context} may degrade")


def main(argv: List[str]) -> int:
    from .launch import run_command

    return run_command("infer", argv, parse, run)
