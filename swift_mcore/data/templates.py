"""Chat templates: a conversation -> token ids, each marked with the assistant turn it trains.

A conversation is rendered as a list of text pieces, each either context (never trained on)
or the answer of assistant turn k (trained on). Pieces are tokenized one by one and
concatenated, so a label mask lands on exact token boundaries: the tokens of the answer and
its end-of-turn marker, nothing of the prompt.

Built-in templates (``--template chatml|plain``) spell the pieces directly and end every
answer with the tokenizer's end-of-document token, where generation stops. The tokenizer's
own Jinja template (``--template tokenizer``) is rendered incrementally: answer k is what
rendering the first k+1 messages adds to rendering the first k with the generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..arguments import ArgumentError

CONTEXT = -1  # turn index of a context token
Piece = Tuple[str, int]  # (text, CONTEXT or the assistant turn it answers)


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    system: str      # format of the system message
    user: str        # format of a user message, including the assistant's cue
    answer_end: str  # text closing an answer (the end-of-document token follows it)
    separator: str   # context text after an answer, before the next message

    def pieces(self, messages) -> List[Piece]:
        pieces: List[Piece] = []
        turn = 0
        for message in messages:
            role, content = message["role"], message["content"]
            if turn and pieces[-1][1] != CONTEXT:  # a message after an answer
                pieces.append((self.separator, CONTEXT))
            if role == "system":
                pieces.append((self.system.format(content=content), CONTEXT))
            elif role == "user":
                pieces.append((self.user.format(content=content), CONTEXT))
            else:
                pieces.append((content + self.answer_end, turn))
                pieces.append((None, turn))  # the end-of-document token
                turn += 1
        return pieces


BUILTIN = {
    "chatml": BuiltinTemplate(
        "chatml", system="<|im_start|>system\n{content}<|im_end|>\n",
        user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
        answer_end="<|im_end|>", separator="\n"),
    "plain": BuiltinTemplate(
        "plain", system="{content}\n\n", user="### User:\n{content}\n\n### Assistant:\n",
        answer_end="", separator="\n\n"),
}


def has_chatml_tokens(tokenizer) -> bool:
    """Whether <|im_start|> and <|im_end|> are single tokens (else ChatML's markers cost
    several tokens each, and the plain template reads better)."""
    vocab = tokenizer.vocab
    return "<|im_start|>" in vocab and "<|im_end|>" in vocab


class Template:
    """``Template(name, tokenizer).encode(messages) -> (ids, turns)``: int32 token ids and,
    per token, the assistant turn it belongs to (CONTEXT for everything else)."""

    def __init__(self, name: str, tokenizer, system: Optional[str] = None):
        self.tokenizer = tokenizer
        self.default_system = system
        has_own = bool(getattr(getattr(tokenizer, "_hf", None), "chat_template", None))
        if name == "auto":
            name = "tokenizer" if has_own else "chatml" if has_chatml_tokens(
                tokenizer) else "plain"
        if name == "tokenizer" and not has_own:
            raise ArgumentError(
                f"--template tokenizer: the tokenizer ({tokenizer.source}) has no chat "
                f"template; choose a built-in one: --template {' or '.join(BUILTIN)}")
        if name != "tokenizer" and name not in BUILTIN:
            raise ArgumentError(f"--template {name}: no such template; choose auto, "
                                f"tokenizer, {', '.join(BUILTIN)}")
        self.name = name

    def describe(self) -> str:
        return (f"the tokenizer's chat template ({self.tokenizer.source})"
                if self.name == "tokenizer" else f"built-in '{self.name}'")

    def pieces(self, messages) -> List[Piece]:
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        if self.name == "tokenizer":
            return self._rendered_pieces(messages)
        return BUILTIN[self.name].pieces(messages)

    def prompt(self, messages) -> List[int]:
        """Token ids of a conversation that ends with a user message, followed by the
        assistant's cue: what generation continues from (swift-mcore infer --template)."""
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        if self.name == "tokenizer":
            # Piece by piece, as in training: earlier answers get the same tokens.
            texts = [text for text, _ in self._rendered_pieces(messages, prompt=True) if text]
            return [i for ids in self.tokenizer.encode_batch(texts) for i in ids]
        ids, _ = self.encode_many([messages])[0]  # the user format ends with the cue
        return ids.tolist()

    def answer_text(self, text: str) -> str:
        """A generated answer without the template's end-of-turn marker."""
        end = BUILTIN[self.name].answer_end if self.name in BUILTIN else ""
        return text[:-len(end)] if end and text.endswith(end) else text

    def encode(self, messages) -> Tuple[np.ndarray, np.ndarray]:
        return self.encode_many([messages])[0]

    def encode_many(self, conversations: Sequence) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Tokenizes the pieces of many conversations in one batch call."""
        all_pieces = [self.pieces(messages) for messages in conversations]
        texts = [text for pieces in all_pieces for text, _ in pieces if text]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else [])
        eod = self.tokenizer.eod
        out = []
        for pieces in all_pieces:
            ids: List[int] = []
            turns: List[int] = []
            for text, turn in pieces:
                if text is None:  # an answer's end: the EOD, unless its marker already is
                    piece_ids = [] if ids and ids[-1] == eod else [eod]
                else:
                    piece_ids = next(encoded) if text else []
                ids.extend(piece_ids)
                turns.extend([turn] * len(piece_ids))
            out.append((np.asarray(ids, dtype=np.int32), np.asarray(turns, dtype=np.int32)))
        return out

    def _rendered_pieces(self, messages, prompt: bool = False) -> List[Piece]:
        """The conversation's pieces; with ``prompt``, the last one ends with the assistant's
        cue (the generation prompt)."""
        hf = self.tokenizer.hf

        def render(upto: int, cue: bool) -> str:
            return hf.apply_chat_template(list(messages[:upto]), tokenize=False,
                                          add_generation_prompt=cue)

        pieces: List[Piece] = []
        done, turn = "", 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, full = render(i, True), render(i + 1, False)
            if not (before.startswith(done) and full.startswith(before)):
                raise ArgumentError(
                    f"--template tokenizer: the chat template of {self.tokenizer.source} does "
                    f"not render a conversation as a growing prefix (it rewrites earlier "
                    f"turns), so the answer tokens cannot be located; use --template "
                    f"chatml or plain")
            pieces.append((before[len(done):], CONTEXT))
            pieces.append((full[len(before):], turn))
            done, turn = full, turn + 1
        rest = render(len(messages), prompt)
        if not rest.startswith(done):
            raise ArgumentError(f"--template tokenizer: the chat template of "
                                f"{self.tokenizer.source} rewrites earlier turns; use "
                                f"--template chatml or plain")
        pieces.append((rest[len(done):], CONTEXT))
        return pieces
