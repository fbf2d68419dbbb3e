"""The one error training raises for bad input."""


class TrainError(RuntimeError):
    """Bad training input (data, checkpoint, config) detected before anything is overwritten."""
