"""Conversation rows (messages with tools and tool calls, or query/response/system/history) read and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..errors import ArgumentError
from ..input_files import check_json_depth
from .sources import Source, read_batches

Message = Dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
# Optional keys a message keeps (the names chat templates read); others are dropped.
OPTIONAL_KEYS = ("tool_calls", "reasoning_content", "name", "tool_call_id")


@dataclass(frozen=True)
class Conversation:
    """One row: its messages, the tools offered to the model (JSON schemas, or None), and
    where it came from (file and row, for every error about it)."""

    messages: List[Message]
    tools: Optional[List[Dict[str, Any]]] = None
    where: str = "a conversation"


# Columns of multimodal rows (ms-swift's names): today's models read text only.
MEDIA_COLUMNS = ("images", "videos", "audios")


def read_conversations(sources: Sequence[Source], columns: Dict[str, str],
                       flag: str = "--dataset") -> List[Conversation]:
    """Every row of every source as a Conversation, in file order."""
    conversations: List[Conversation] = []
    present: Dict[str, None] = {}
    for source in sources:
        before = len(conversations)
        for index, row in enumerate(_rows(source, flag)):
            present.update(dict.fromkeys(row))
            where = f"{flag} {source.path}, row {index}"
            row = {columns.get(k, k): v for k, v in row.items()}
            _refuse_media(row, where)
            conversations.append(to_conversation(row, where))
        if len(conversations) == before:
            raise ArgumentError(f"{flag} {source.path}: is empty (no rows)")
    missing = [c for c in columns if c not in present]
    if missing:
        what = sources[0].path if len(sources) == 1 else f"{len(sources)} files"
        raise ArgumentError(
            f"{flag} {what}: --columns renames '{missing[0]}', a column the data does not "
            f"have (its columns: {', '.join(repr(c) for c in present) or 'none'})")
    return conversations


def _refuse_media(row: Dict[str, Any], where: str) -> None:
    """A multimodal row trained as plain text would lose its images without a word."""
    for name in MEDIA_COLUMNS:
        value = row.get(name)
        if value is None or (isinstance(value, (list, tuple, str, dict)) and not value):
            continue
        tag = f"<{name[:-1]}>"
        mentioned = tag in json.dumps(row.get("messages") or row.get("query") or "",
                                      default=str)
        raise ArgumentError(
            f"{where}: column '{name}' holds {name}"
            f"{f' (the text refers to them with {tag})' if mentioned else ''}; a text "
            f"model trained on the text alone would drop them: "
            + ("give --model a vision-language model (Qwen2.5-VL, Qwen3-VL: "
               "docs/multimodal.md)" if name in ("images", "videos") else
               f"{name} are not supported") + ", or remove the column to train on the text")


def _rows(source: Source, flag: str) -> Iterator[Dict[str, Any]]:
    for batch in read_batches(source, flag, batch_size=256):
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            yield dict(zip(names, values))


def to_conversation(row: Dict[str, Any], where: str) -> Conversation:
    """One row -> a Conversation (its messages and its 'tools' column)."""
    return Conversation(to_messages(row, where), _tools(row.get("tools"), where), where)


def to_messages(row: Dict[str, Any], where: str) -> List[Message]:
    """One row -> messages. ``where`` names the file and row in every error."""
    if row.get("messages") is not None:
        messages = _checked_messages(row["messages"], where)
    elif row.get("query") is not None or row.get("response") is not None:
        messages = _from_pairs(row, where)
    else:
        present = ", ".join(repr(k) for k, v in row.items() if v is not None) or "none"
        raise ArgumentError(
            f"{where}: no 'messages' column and no 'query'/'response' columns (it has "
            f"{present}); rename yours with --columns, e.g. --columns instruction=query "
            f"output=response")
    if not any(m["role"] == "assistant" for m in messages):
        raise ArgumentError(f"{where}: the conversation has no assistant turn, so there is "
                            f"nothing to learn from it")
    return messages


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise ArgumentError(f"{where}: {what} must be text, got "
                            f"{type(value).__name__} {value!r:.80}")
    return value


def _json_value(value: Any, where: str, what: str, kind: type) -> Any:
    """A value given as JSON text (as OpenAI-style data stores tools and arguments) parsed;
    chat templates expect the objects themselves (they render them with tojson)."""
    if isinstance(value, str):
        check_json_depth(value, f"{where}: {what}")
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ArgumentError(f"{where}: {what} is text but not valid JSON ({err})") from None
    if not isinstance(value, kind):
        name = "an object" if kind is dict else "a list"
        raise ArgumentError(f"{where}: {what} must be {name} (or its JSON text), got "
                            f"{type(value).__name__} {value!r:.80}")
    return value


def _tools(value: Any, where: str) -> Optional[List[Dict[str, Any]]]:
    if value is None:
        return None
    tools = _json_value(value, where, "'tools'", list)
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ArgumentError(f"{where}: tool {i} of 'tools' must be an object (a JSON "
                                f"schema such as {{\"type\": \"function\", \"function\": "
                                f"{{\"name\": ..., \"parameters\": ...}}}}); got {tool!r:.80}")
    return tools or None


def _tool_calls(value: Any, where: str, i: int) -> List[Dict[str, Any]]:
    calls = _json_value(value, where, f"message {i}'s tool_calls", list)
    checked = []
    for j, call in enumerate(calls):
        what = f"message {i}'s tool call {j}"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ArgumentError(f"{where}: {what} must be an object with a 'function' holding "
                                f"'name' and 'arguments'; got {call!r:.80}")
        function = dict(function)
        if "arguments" in function:
            function["arguments"] = _json_value(function["arguments"], where,
                                                f"{what}'s arguments", dict)
        checked.append({**call, "function": function} if "function" in call else
                       {"type": "function", "function": function})
    return checked


def _checked_messages(value: Any, where: str) -> List[Message]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ArgumentError(f"{where}: 'messages' must be a non-empty list of "
                            f"{{\"role\", \"content\"}} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or (
                "content" not in message and not message.get("tool_calls")):
            raise ArgumentError(f"{where}: message {i} must be an object with 'role' and "
                                f"'content'; got {message!r:.80}")
        role = message["role"]
        if role not in ROLES:
            raise ArgumentError(f"{where}: message {i} has role {role!r}; accepted roles: "
                                f"{', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise ArgumentError(f"{where}: message {i} is a system message; only the first "
                                f"message may be one")
        content = message.get("content")
        checked: Message = {"role": role}
        # An assistant message that only calls tools may have no content (OpenAI's null).
        if content is not None or not message.get("tool_calls"):
            checked["content"] = _text(content, where, f"message {i}'s content")
        else:
            checked["content"] = ""
        for key in OPTIONAL_KEYS:
            if message.get(key) is None:
                continue
            if key == "tool_calls":
                if role != "assistant":
                    raise ArgumentError(f"{where}: message {i} ({role}) has tool_calls; only "
                                        f"assistant messages call tools")
                checked[key] = _tool_calls(message[key], where, i)
            else:
                checked[key] = _text(message[key], where, f"message {i}'s {key}")
        messages.append(checked)
    return messages


def _from_pairs(row: Dict[str, Any], where: str) -> List[Message]:
    for name in ("query", "response"):
        if row.get(name) is None:
            raise ArgumentError(f"{where}: has '{'response' if name == 'query' else 'query'}'"
                                f" but no '{name}' column value")
    messages: List[Message] = []
    if row.get("system") is not None:
        messages.append({"role": "system", "content": _text(row["system"], where, "system")})
    for i, pair in enumerate(row.get("history") or []):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ArgumentError(f"{where}: history entry {i} must be a [query, response] "
                                f"pair; got {pair!r:.80}")
        messages.append({"role": "user", "content": _text(pair[0], where, f"history {i}")})
        messages.append({"role": "assistant", "content": _text(pair[1], where,
                                                                 f"history {i}")})
    messages.append({"role": "user", "content": _text(row["query"], where, "query")})
    messages.append({"role": "assistant", "content": _text(row["response"], where,
                                                           "response")})
    return messages
