"""Chat templates: a conversation -> token ids, each marked with the assistant turn it trains.

A conversation is rendered as a list of text pieces, each either context (never trained on)
or the answer of assistant turn k (trained on). The whole text is tokenized at once, so
training sees the ids a Hugging Face user gets from ``apply_chat_template`` at inference,
and each token takes the turn of the piece its characters fall in (the tokenizer's character
offsets): the tokens of the answer and its end-of-turn marker, nothing of the prompt.

Built-in templates (``--template chatml|plain``) spell the pieces directly and end every
answer with the tokenizer's end-of-document token, where generation stops. The tokenizer's
own Jinja template (``--template tokenizer``) is rendered incrementally: answer k is what
rendering the first k+1 messages adds to rendering the first k with the generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError

CONTEXT = -1  # turn index of a context token
# (text, CONTEXT or the assistant turn it answers); text None: the end-of-document token
Piece = Tuple[Optional[str], int]


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    system: str      # format of the system message
    user: str        # format of a user message
    cue: str         # the assistant's cue, after a user message an answer follows
    answer_end: str  # text closing an answer (the end-of-document token follows it)
    separator: str   # context text after an answer, before the next message

    def pieces(self, messages, generation_prompt: bool = False) -> List[Piece]:
        pieces: List[Piece] = []
        turn = 0
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if i and messages[i - 1]["role"] == "assistant":
                pieces.append((self.separator, CONTEXT))
            if role == "system":
                pieces.append((self.system.format(content=content), CONTEXT))
            elif role == "user":
                following = messages[i + 1]["role"] if i + 1 < len(messages) else None
                answered = following == "assistant" or (following is None and
                                                        generation_prompt)
                # One piece with the cue: tokenized as a whole, as HF would render it.
                pieces.append((self.user.format(content=content) + (self.cue if answered
                                                                    else ""), CONTEXT))
            else:
                pieces.append((content + self.answer_end, turn))
                pieces.append((None, turn))  # the end-of-document token
                turn += 1
        return pieces

    def jinja(self, eos_token: str, default_system: Optional[str] = None) -> str:
        """The same rendering as a Hugging Face chat template, saved with an exported
        model so that ``apply_chat_template`` gives what training saw."""
        def lit(text: str) -> str:
            return "{{ " + repr(text) + " }}"

        def fmt(template: str) -> str:
            before, after = template.split("{content}")
            return lit(before) + "{{ message['content'] }}" + lit(after)

        end = lit(self.answer_end) + ("" if self.answer_end == eos_token else lit(eos_token))
        system = ""
        if default_system is not None:
            system = ("{%- if messages[0]['role'] != 'system' -%}"
                      + lit(self.system.format(content=default_system)) + "{%- endif -%}")
        return (
            system
            + "{%- for message in messages -%}"
            "{%- if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'assistant' -%}"
            + lit(self.separator) + "{%- endif -%}"
            "{%- if message['role'] == 'system' -%}" + fmt(self.system)
            + "{%- elif message['role'] == 'user' -%}" + fmt(self.user)
            + "{%- if (loop.last and add_generation_prompt) or (not loop.last and "
            "messages[loop.index0 + 1]['role'] == 'assistant') -%}" + lit(self.cue)
            + "{%- endif -%}"
            "{%- else -%}{{ message['content'] }}" + end + "{%- endif -%}"
            "{%- endfor -%}")


BUILTIN = {
    "chatml": BuiltinTemplate(
        "chatml", system="<|im_start|>system\n{content}<|im_end|>\n",
        user="<|im_start|>user\n{content}<|im_end|>\n", cue="<|im_start|>assistant\n",
        answer_end="<|im_end|>", separator="\n"),
    "plain": BuiltinTemplate(
        "plain", system="{content}\n\n", user="### User:\n{content}\n\n",
        cue="### Assistant:\n", answer_end="", separator="\n\n"),
}


def attach_chat_template(tokenizer, sft_flags: Optional[dict]) -> Optional[str]:
    """Gives the tokenizer of a run finetuned with a built-in template that template as its
    Hugging Face chat template (export writes it to tokenizer_config.json). Returns the
    template's name, or None when there is nothing to attach."""
    if not sft_flags or tokenizer.chat_template:
        return None
    name = sft_flags.get("template", "auto")
    if name == "auto":
        name = "chatml" if has_chatml_tokens(tokenizer) else "plain"
    if name not in BUILTIN:
        return None
    eos = tokenizer.hf.convert_ids_to_tokens(tokenizer.eod)
    tokenizer.hf.chat_template = BUILTIN[name].jinja(eos, sft_flags.get("system"))
    return name


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
        has_own = bool(tokenizer.chat_template)
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
        if tokenizer.backend is None:
            raise ArgumentError(f"sft needs a fast (Rust) Hugging Face tokenizer, whose "
                                f"character offsets place the answer tokens; "
                                f"{tokenizer.source} loaded as a slow one")
        self.eod_text = tokenizer.backend.id_to_token(tokenizer.eod)

    def describe(self) -> str:
        return (f"the tokenizer's chat template ({self.tokenizer.source})"
                if self.name == "tokenizer" else f"built-in '{self.name}'")

    def pieces(self, messages, generation_prompt: bool = False) -> List[Piece]:
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        if self.name == "tokenizer":
            return self._rendered_pieces(messages, prompt=generation_prompt)
        return BUILTIN[self.name].pieces(messages, generation_prompt)

    def prompt(self, messages) -> List[int]:
        """Token ids of a conversation that ends with a user message, followed by the
        assistant's cue: what generation continues from (swift-mcore infer --template)."""
        ids, _ = self.encode_many([messages], generation_prompt=True)[0]
        return ids.tolist()

    def end_marker(self) -> str:
        """The text that closes an answer (ChatML's <|im_end|>; '' when only the EOD does):
        generation stops there even when the tokenizer's EOD is another token."""
        if self.name in BUILTIN:
            return BUILTIN[self.name].answer_end
        probe = "\x00answer\x00"
        user = [{"role": "user", "content": "?"}]
        hf = self.tokenizer.hf
        before = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = hf.apply_chat_template(user + [{"role": "assistant", "content": probe}],
                                      tokenize=False)
        after = full[len(before):].split(probe, 1)[-1] if full.startswith(before) else ""
        return after.strip().replace(self.eod_text, "")

    def answer_text(self, text: str) -> str:
        """A generated answer, cut at the template's end-of-turn marker."""
        end = self.end_marker()
        return text.split(end, 1)[0] if end else text

    def encode(self, messages) -> Tuple[np.ndarray, np.ndarray]:
        return self.encode_many([messages])[0]

    def encode_many(self, conversations: Sequence, generation_prompt: bool = False
                    ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Tokenizes whole conversations in one batch call; each token takes the turn of the
        piece its characters fall in (an answer wins over context when a token spans both,
        e.g. a space of the cue merged into the answer's first word)."""
        texts, layouts = [], []
        for messages in conversations:
            text, bounds, turns = self._text_of(self.pieces(messages, generation_prompt))
            texts.append(text)
            layouts.append((bounds, turns))
        encodings = self.tokenizer.backend.encode_batch(texts, add_special_tokens=False)
        out = []
        for encoding, (bounds, turns) in zip(encodings, layouts):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            spans = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            first = np.searchsorted(bounds, spans[:, 0], side="right") - 1
            last = np.searchsorted(bounds, np.maximum(spans[:, 1] - 1, spans[:, 0]),
                                   side="right") - 1
            token_turns = np.maximum(turns[first.clip(0)], turns[last.clip(0)])
            out.append((ids, token_turns.astype(np.int32)))
        return out

    def _text_of(self, pieces: List[Piece]):
        """The conversation's text, and where each piece starts in it with its turn. An
        answer's end (a None piece) is the end-of-document token's text, unless the answer
        already ends with it (ChatML with a tokenizer whose EOS is <|im_end|>)."""
        eod_text = self.eod_text
        parts: List[str] = []
        bounds: List[int] = []
        turns: List[int] = []
        size = 0
        for text, turn in pieces:
            if text is None:
                if parts and parts[-1].endswith(eod_text):
                    continue
                text = eod_text
            if not text:
                continue
            parts.append(text)
            bounds.append(size)
            turns.append(turn)
            size += len(text)
        return ("".join(parts), np.asarray(bounds, dtype=np.int64),
                np.asarray(turns, dtype=np.int64))

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
