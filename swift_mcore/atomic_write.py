"""Writing a file so that readers see its old content or its new one, never a part (a
temporary sibling, fsync, rename); a leaf that the data and checkpoint modules share.

The rename replaces the name ``path``: a link planted there is replaced itself, never
followed, and the file it pointed to is left as it was. The temporary sibling is a new file
(``O_EXCL``, never a link), so nothing planted under its name is written through either."""

from __future__ import annotations

import os
import uuid
from typing import IO, Callable, Union

_NEW_FILE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))


def temp_name(path: str) -> str:
    """A sibling of ``path`` no other process will pick (same folder, so os.replace is atomic)."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_atomic(path: str, content: Union[str, bytes, Callable[[IO], None]]) -> None:
    """``path`` holds ``content`` (text, bytes, or what a writer function writes into the
    open binary file), or keeps what it held: a failure leaves no temporary file behind."""
    tmp = temp_name(path)
    created = False
    try:
        fd = os.open(tmp, _NEW_FILE, 0o644)
        created = True
        with os.fdopen(fd, "w" if isinstance(content, str) else "wb",
                       **({"encoding": "utf-8"} if isinstance(content, str) else {})) as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        created = False
    finally:
        if created:
            try:
                os.remove(tmp)
            except OSError:
                pass
