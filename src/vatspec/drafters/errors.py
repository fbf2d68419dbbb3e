"""The error every way of opening a draft raises (the drafters' own, below their formats and checkpoints)."""


class CheckpointError(RuntimeError):
    """A draft is missing, incomplete or does not fit the target: a training checkpoint (``vatspec.checkpoint``),
    or a served folder (``ExportError``, a subclass)."""
