"""Writing a file so that readers see its old content or its new one, never a part (a
temporary sibling, fsync, rename); a leaf that the data and checkpoint modules share."""

from __future__ import annotations

import os
import uuid
from typing import IO, Callable, Union


def temp_name(path: str) -> str:
    """A sibling of ``path`` no other process will pick (same folder, so os.replace is atomic)."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_atomic(path: str, content: Union[str, bytes, Callable[[IO], None]]) -> None:
    """``path`` holds ``content`` (text, bytes, or what a writer function writes into the
    open binary file), or keeps what it held: a failure leaves no temporary file behind."""
    tmp = temp_name(path)
    try:
        with open(tmp, "w" if isinstance(content, str) else "wb",
                  **({"encoding": "utf-8"} if isinstance(content, str) else {})) as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
