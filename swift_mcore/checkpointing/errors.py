"""The one error type the checkpoint module raises for bad or unusable checkpoints."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used as asked. The message names the path, what is wrong, and
    the flag that changes the decision; nothing on disk has been modified."""
