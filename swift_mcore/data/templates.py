"""Chat templates: a conversation -> token ids, each marked with the assistant turn it trains.

A conversation is rendered as one or more samples, each a list of text pieces, each piece
either context (never trained on) or the answer of assistant turn k (trained on). A sample's
whole text is tokenized at once, so training sees the ids a Hugging Face user gets from
``apply_chat_template`` at inference, and each token takes the turn of the piece its
characters fall in (the tokenizer's character offsets): the tokens of the answer (its text,
its tool calls, its reasoning) and its end-of-turn marker, nothing of the prompt.

Built-in templates (``--template chatml|plain``) spell the pieces directly and end every
answer with the tokenizer's end-of-document token, where generation stops; they render no
tools. The tokenizer's own Jinja template (``--template tokenizer``) is rendered
incrementally: answer k is what rendering the first k+1 messages (and the row's tools) adds
to rendering the first k with the generation prompt; with ``{% generation %}`` markers in
the template, the marked text is the answer instead. A template that renders the history
of turn k otherwise than as the text of turn k-1 (Qwen3 drops earlier turns' reasoning)
starts a new sample at turn k: its history as the template renders it there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError

CONTEXT = -1  # turn index of a context token
# (text, CONTEXT or the assistant turn it answers); text None: the end-of-document token
Piece = Tuple[Optional[str], int]
# transformers' marker of the text an assistant generates (return_assistant_tokens_mask)
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# An answer that opens with a reasoning block holding nothing (Qwen3's template writes one
# into answers without reasoning): --ignore_empty_think leaves it untrained.
EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    system: str      # format of the system message
    user: str        # format of a user message
    cue: str         # the assistant's cue, after a user message an answer follows
    answer_end: str  # text closing an answer (the end-of-document token follows it)
    separator: str   # context text after an answer, before the next message

    def pieces(self, messages, generation_prompt: bool = False,
               train_separator: bool = False) -> List[Piece]:
        pieces: List[Piece] = []
        turn = 0
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if i and messages[i - 1]["role"] == "assistant":
                pieces.append((self.separator, turn - 1 if train_separator else CONTEXT))
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


def as_conversation(conversation):
    """A Conversation (conversations.py), or a plain list of messages as one."""
    if hasattr(conversation, "messages"):
        return conversation
    from .conversations import Conversation

    return Conversation(list(conversation))


# What a row may need a template to render, each with a probe conversation whose rendering
# must contain the probe word. A template that leaves it out would silently drop it.
_PROBE = "zqprobe"
_FEATURES = {
    "tools": ("a 'tools' list", [{"role": "user", "content": "?"}],
              [{"type": "function", "function": {
                  "name": _PROBE, "description": "d",
                  "parameters": {"type": "object", "properties": {}}}}]),
    "tool_calls": ("tool_calls (message {i})", [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": _PROBE, "arguments": {}}}]}], None),
    "tool": ("a 'tool' message (message {i})", [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": _PROBE}], None),
    "reasoning_content": ("reasoning_content (message {i})", [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "A", "reasoning_content": _PROBE}], None),
}


def _features(conversation) -> List[Tuple[str, str]]:
    """(feature, description) of each optional thing the conversation uses, first use."""
    found: Dict[str, str] = {}
    if conversation.tools:
        found["tools"] = _FEATURES["tools"][0]
    for i, m in enumerate(conversation.messages):
        for key in ("tool_calls", "reasoning_content"):
            if m.get(key) and key not in found:
                found[key] = _FEATURES[key][0].format(i=i)
        if m["role"] == "tool" and "tool" not in found:
            found["tool"] = _FEATURES["tool"][0].format(i=i)
    return list(found.items())


class Template:
    """``Template(name, tokenizer).encode_samples(conversation) -> [(ids, turns), ...]``:
    per sample, int32 token ids and, per token, the assistant turn it trains (CONTEXT for
    everything else). Most conversations are one sample (``encode``)."""

    def __init__(self, name: str, tokenizer, system: Optional[str] = None,
                 train_separator: bool = False, ignore_empty_think: bool = False):
        self.tokenizer = tokenizer
        self.default_system = system
        self.train_separator = train_separator
        self.ignore_empty_think = ignore_empty_think
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
        self._renders: Dict[str, bool] = {}
        self._end: Optional[str] = None
        self._marked: Dict[bool, bool] = {}

    def identity(self) -> dict:
        """Everything of the template that decides tokens (for the token cache's key); the
        tokenizer's fingerprint covers its vocabulary, not its Jinja text."""
        return {"name": self.name, "system": self.default_system,
                "train_separator": self.train_separator,
                "ignore_empty_think": self.ignore_empty_think,
                "chat_template": (self.tokenizer.chat_template if self.name == "tokenizer"
                                  else None)}

    def marks_answers(self, tools: bool = False) -> bool:
        """Whether the tokenizer's template (its tool-use one, for a row with tools) marks
        answers with {% generation %}."""
        if self.name != "tokenizer":
            return False
        if tools not in self._marked:
            jinja = self.tokenizer.hf.get_chat_template(None, [{}] if tools else None)
            self._marked[tools] = bool(GENERATION_TAG.search(jinja))
        return self._marked[tools]

    @property
    def marked(self) -> bool:
        return self.marks_answers()

    def describe(self) -> str:
        if self.name != "tokenizer":
            return f"built-in '{self.name}'"
        marks = ", answers as its {% generation %} blocks" if self.marked else ""
        return f"the tokenizer's chat template ({self.tokenizer.source}{marks})"

    def _with_system(self, conversation):
        conversation = as_conversation(conversation)
        messages = conversation.messages
        if self.default_system is not None and messages[0]["role"] != "system":
            from dataclasses import replace

            conversation = replace(conversation, messages=[
                {"role": "system", "content": self.default_system}, *messages])
        return conversation

    def samples(self, conversation, generation_prompt: bool = False) -> List[List[Piece]]:
        """The conversation's samples, each a list of pieces."""
        conversation = self._with_system(conversation)
        self._check_renders(conversation)
        if self.name == "tokenizer":
            samples = self._rendered_samples(conversation, generation_prompt)
        else:
            samples = [BUILTIN[self.name].pieces(conversation.messages, generation_prompt,
                                                 self.train_separator)]
        if self.ignore_empty_think:
            samples = [_untrain_empty_think(pieces) for pieces in samples]
        return samples

    def prompt(self, messages) -> List[int]:
        """Token ids of a conversation that ends with a user message, followed by the
        assistant's cue: what generation continues from (swift-mcore infer --template)."""
        if self.name == "tokenizer":
            conversation = self._with_system(messages)
            text = self._render(conversation, len(conversation.messages), True)
            return self.tokenizer.backend.encode(text, add_special_tokens=False).ids
        ids, _ = self.encode_many([messages], generation_prompt=True)[0][0]
        return ids.tolist()

    def end_marker(self) -> str:
        """The text that closes an answer (ChatML's <|im_end|>; '' when only the EOD does):
        generation stops there even when the tokenizer's EOD is another token."""
        if self.name in BUILTIN:
            return BUILTIN[self.name].answer_end
        if self._end is None:
            probe = "\x00answer\x00"
            user = [{"role": "user", "content": "?"}]
            hf = self.tokenizer.hf
            before = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = hf.apply_chat_template(user + [{"role": "assistant", "content": probe}],
                                          tokenize=False)
            after = full[len(before):].split(probe, 1)[-1] if full.startswith(before) else ""
            self._end = after.strip().replace(self.eod_text, "")
        return self._end

    def answer_text(self, text: str) -> str:
        """A generated answer, cut at the template's end-of-turn marker."""
        end = self.end_marker()
        return text.split(end, 1)[0] if end else text

    def encode(self, messages) -> Tuple[np.ndarray, np.ndarray]:
        """The (ids, turns) of a conversation that renders as one sample."""
        samples = self.encode_samples(messages)
        if len(samples) != 1:
            raise ValueError(f"the conversation renders as {len(samples)} samples; use "
                             f"encode_samples")
        return samples[0]

    def encode_samples(self, conversation) -> List[Tuple[np.ndarray, np.ndarray]]:
        return self.encode_many([conversation])[0]

    def encode_many(self, conversations: Sequence, generation_prompt: bool = False
                    ) -> List[List[Tuple[np.ndarray, np.ndarray]]]:
        """Per conversation, its samples' (ids, turns), all tokenized in one batch call; each
        token takes the turn of the piece its characters fall in (an answer wins over
        context when a token spans both, e.g. a space of the cue merged into the answer's
        first word)."""
        texts, layouts, counts = [], [], []
        for conversation in conversations:
            samples = self.samples(conversation, generation_prompt)
            counts.append(len(samples))
            for pieces in samples:
                text, bounds, turns = self._text_of(pieces)
                texts.append(text)
                layouts.append((bounds, turns))
        encodings = self.tokenizer.backend.encode_batch(texts, add_special_tokens=False)
        flat = []
        for encoding, (bounds, turns) in zip(encodings, layouts):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            spans = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            first = np.searchsorted(bounds, spans[:, 0], side="right") - 1
            last = np.searchsorted(bounds, np.maximum(spans[:, 1] - 1, spans[:, 0]),
                                   side="right") - 1
            token_turns = np.maximum(turns[first.clip(0)], turns[last.clip(0)])
            flat.append((ids, token_turns.astype(np.int32)))
        out, at = [], 0
        for n in counts:
            out.append(flat[at:at + n])
            at += n
        return out

    def _text_of(self, pieces: List[Piece]):
        """The sample's text, and where each piece starts in it with its turn. An answer's
        end (a None piece) is the end-of-document token's text, unless the answer already
        ends with it (ChatML with a tokenizer whose EOS is <|im_end|>)."""
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

    # ---- what a template can render -------------------------------------------------

    def _check_renders(self, conversation) -> None:
        """Refuses a row that uses what the template would leave out (tools, tool calls,
        tool results, reasoning), naming the row: dropping them silently would train on
        another conversation than the row's."""
        for feature, what in _features(conversation):
            if self.name != "tokenizer":
                raise ArgumentError(
                    f"{conversation.where}: the conversation has {what}, which the built-in "
                    f"template '{self.name}' does not render; use --template tokenizer with "
                    f"a tokenizer whose chat template renders tools and reasoning (such as "
                    f"Qwen2.5's or Qwen3's), or leave them out of the row")
            if not self._renders_feature(feature):
                raise ArgumentError(
                    f"{conversation.where}: the conversation has {what}, which the chat "
                    f"template of {self.tokenizer.source} does not render (it would be "
                    f"dropped from training); give --tokenizer one whose template renders "
                    f"it, or leave it out of the row")

    def _renders_feature(self, feature: str) -> bool:
        if feature not in self._renders:
            _, messages, tools = _FEATURES[feature]
            try:
                text = self.tokenizer.hf.apply_chat_template(
                    messages, tools=tools, tokenize=False,
                    add_generation_prompt=messages[-1]["role"] != "assistant")
                self._renders[feature] = _PROBE in text
            except Exception:  # a template's raise_exception, or a Jinja error
                self._renders[feature] = False
        return self._renders[feature]

    # ---- the tokenizer's own template -------------------------------------------------

    def _render(self, conversation, upto: int, cue: bool) -> str:
        try:
            return self.tokenizer.hf.apply_chat_template(
                list(conversation.messages[:upto]), tools=conversation.tools, tokenize=False,
                add_generation_prompt=cue)
        except Exception as err:  # a template's raise_exception, or a Jinja error
            text = (str(err).strip().splitlines() or [""])[0][:200]
            raise ArgumentError(
                f"{conversation.where}: the chat template of {self.tokenizer.source} cannot "
                f"render this conversation ({type(err).__name__}: {text})") from None

    def _rendered_samples(self, conversation, prompt: bool = False) -> List[List[Piece]]:
        """Answer k spans what rendering messages[:i+1] adds to rendering messages[:i] with
        the generation prompt. While each rendering extends the one before, the answers
        share one sample; when the prompt of turn k does not extend the text of turn k-1
        (the template rewrote the history), turn k starts a new sample from that prompt."""
        messages = conversation.messages
        samples: List[Tuple[str, list, int]] = []  # (text, answer spans, last message)
        text, spans, last, turn = "", [], -1, 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(conversation, i, True)
            full = self._render(conversation, i + 1, False)
            if not full.startswith(before):
                raise ArgumentError(
                    f"{conversation.where}: the chat template of {self.tokenizer.source} "
                    f"renders assistant message {i} without the generation prompt before it "
                    f"(it rewrites earlier text when the answer is added), so the answer "
                    f"tokens cannot be located; use --template chatml or plain")
            if not before.startswith(text):
                samples.append((text, spans, last))
                spans = []
            spans.append(self._answer_span(full, len(before), turn))
            text, last, turn = full, i, turn + 1
        rest = self._render(conversation, len(messages), prompt)
        samples.append((rest if rest.startswith(text) else text, spans, last))
        if self.marks_answers(bool(conversation.tools)):
            samples = [(text, self._marked_spans(conversation, text, spans, last), last)
                       for text, spans, last in samples]
        return [_pieces(text, spans) for text, spans, _ in samples]

    def _end_texts(self) -> List[str]:
        return [t for t in (self.end_marker(), self.eod_text) if t]

    def _answer_span(self, text: str, start: int, turn: int) -> Tuple[int, int, int]:
        """(start, end, turn) of the answer that fills text[start:]; the whitespace after
        its end-of-turn marker is left out unless --train_separator."""
        end = len(text)
        if not self.train_separator:
            stripped = text[start:].rstrip()
            if any(stripped.endswith(t) for t in self._end_texts()):
                end = start + len(stripped)
        return start, end, turn

    def _marked_spans(self, conversation, text: str, spans, last: int):
        """The answers of a sample as the template's {% generation %} blocks: block j is
        assistant message j's, as transformers' return_assistant_tokens_mask reads them."""
        from transformers.utils.chat_template_utils import render_jinja_template

        hf = self.tokenizer.hf
        tools = conversation.tools
        rendered, blocks = render_jinja_template(
            conversations=[list(conversation.messages[:last + 1])], tools=tools,
            chat_template=hf.get_chat_template(None, tools),
            return_assistant_tokens_mask=True, **hf.special_tokens_map)
        rendered, blocks = rendered[0], blocks[0]
        answers = sum(m["role"] == "assistant" for m in conversation.messages[:last + 1])
        if len(blocks) != answers or not text.startswith(rendered):
            raise ArgumentError(
                f"{conversation.where}: the chat template of {self.tokenizer.source} has "
                f"{len(blocks)} {{% generation %}} blocks for {answers} assistant messages, "
                f"so they cannot be matched to the answers; use --template chatml or plain")
        marked = []
        for _, _, turn in spans:
            start, end = blocks[turn]
            if self.train_separator:
                while end < len(text) and text[end].isspace():
                    end += 1
            marked.append((start, end, turn))
        return marked


def _untrain_empty_think(pieces: List[Piece]) -> List[Piece]:
    """An answer's leading empty reasoning block (and the whitespace around it) made
    context: the rest of the answer, its end-of-turn marker included, stays trained."""
    out: List[Piece] = []
    for text, turn in pieces:
        match = EMPTY_THINK.match(text) if text is not None and turn != CONTEXT else None
        if match and match.end():
            out.append((text[:match.end()], CONTEXT))
            text = text[match.end():]
        out.append((text, turn))
    return out


def _pieces(text: str, spans) -> List[Piece]:
    """A text cut into context and the (start, end, turn) answer spans, in order."""
    pieces: List[Piece] = []
    at = 0
    for start, end, turn in sorted(spans):
        pieces.append((text[at:start], CONTEXT))
        pieces.append((text[start:end], turn))
        at = end
    pieces.append((text[at:], CONTEXT))
    return pieces
