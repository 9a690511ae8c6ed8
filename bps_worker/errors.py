"""Errors a user of the worker daemon and its client libraries can meet."""


class BPSError(RuntimeError):
    """Base class of every failure the client API raises."""


class BPSConnectionError(BPSError):
    """The worker daemon (or, through it, a peer) could not be reached or went away."""


class BPSTimeoutError(BPSError):
    """An operation did not finish within its timeout."""


class BPSMismatchError(BPSError):
    """Processes disagreed about a tensor (shape, dtype or operation) for the same name."""
