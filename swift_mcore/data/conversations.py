"""Conversation rows (messages, or query/response/system/history) read and checked."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence

from ..errors import ArgumentError
from .sources import Source, read_batches

Message = Dict[str, str]
ROLES = ("system", "user", "assistant")


def read_conversations(sources: Sequence[Source], columns: Dict[str, str],
                       flag: str = "--dataset") -> List[List[Message]]:
    """Every row of every source as a list of {role, content} messages, in file order."""
    conversations: List[List[Message]] = []
    for source in sources:
        before = len(conversations)
        for index, row in enumerate(_rows(source, flag)):
            row = {columns.get(k, k): v for k, v in row.items()}
            conversations.append(to_messages(row, f"{flag} {source.path}, row {index}"))
        if len(conversations) == before:
            raise ArgumentError(f"{flag} {source.path}: is empty (no rows)")
    return conversations


def _rows(source: Source, flag: str) -> Iterator[Dict[str, Any]]:
    for batch in read_batches(source, flag, batch_size=256):
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            yield dict(zip(names, values))


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


def _checked_messages(value: Any, where: str) -> List[Message]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ArgumentError(f"{where}: 'messages' must be a non-empty list of "
                            f"{{\"role\", \"content\"}} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ArgumentError(f"{where}: message {i} must be an object with 'role' and "
                                f"'content'; got {message!r:.80}")
        role = message["role"]
        if role not in ROLES:
            raise ArgumentError(f"{where}: message {i} has role {role!r}; accepted roles: "
                                f"{', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise ArgumentError(f"{where}: message {i} is a system message; only the first "
                                f"message may be one")
        messages.append({"role": role,
                         "content": _text(message["content"], where, f"message {i}'s content")})
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
