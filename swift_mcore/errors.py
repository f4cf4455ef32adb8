"""The errors swift-mcore reports to users: one line, exit code 2, no traceback (a leaf module).

Every layer raises these; the CLI catches them. Nothing here imports anything of swift-mcore,
so the arguments, the data and the checkpoint modules can all depend on it.
"""


class ArgumentError(ValueError):
    """Bad input from the user (a flag, a file, a folder), reported before any work starts."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used as asked. The message names the path, what is wrong, and
    the flag that changes the decision; nothing on disk has been modified."""


class NonFiniteError(RuntimeError):
    """Training met a nan or inf loss or gradient norm and stopped before the optimizer step
    (on every rank, at the same iteration). The message names the iteration and the newest
    good checkpoint; no checkpoint holding nan or inf was written."""


class OutputError(RuntimeError):
    """A file swift-mcore writes cannot be written as asked: a link or a foreign file planted
    where it writes, an output path that names a file it did not create, a full disk. The
    message names the path; nothing half-written is left, and no other file was touched."""
