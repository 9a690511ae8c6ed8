"""Errors raised by the protocol package, split by whose fault they are (h11's ``_util.py`` model).

* :class:`LocalProtocolError`: our own side misused the protocol: it built a message with a bad value, or
  asked to send a frame over a limit, or used a frame reader after it failed. Raised *before* anything is
  written, so nothing reaches the peer.
* :class:`RemoteProtocolError`: the peer sent something that breaks the protocol (a bad frame, a bad
  message). The connection it came from must be closed: its byte stream can no longer be trusted.

Both derive from :class:`ProtocolError`, so ``except ProtocolError`` catches either. Inside the package a
message's checks raise the local kind (they run whenever a message is built); the one receive boundary,
:func:`protocol.messages.parse`, re-raises them as the remote kind with :meth:`RemoteProtocolError.from_error`.

Where a limit was exceeded the error keeps its facts as attributes (``what``, ``size``, ``limit``,
``unit``) and builds its message from them, so a caller never parses the text.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of both protocol errors; catch this to catch either kind.

    Still instantiable: code outside ``protocol/`` raises it directly until every caller names the kind.

    Attributes (all optional): ``what`` (the thing that broke a limit, e.g. ``"frame header"``), ``size``
    (how large it was), ``limit`` (the most allowed) and ``unit`` (of size and limit). Without an explicit
    message one is built from them: ``"frame header of 70000 bytes exceeds the limit of 65536 bytes"``.
    """

    what: str
    size: int | None
    limit: int | None
    unit: str

    def __init__(self, message: str = "", *, what: str = "", size: int | None = None, limit: int | None = None,
                 unit: str = "bytes") -> None:
        self.what = what
        self.size = size
        self.limit = limit
        self.unit = unit
        if not message and size is not None and limit is not None:
            message = f"{what or 'value'} of {size} {unit} exceeds the limit of {limit} {unit}"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), str(self), self.what, self.size, self.limit, self.unit))


class LocalProtocolError(ProtocolError):
    """Our own side tried to build or send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something that breaks the protocol (bad frame, bad message)."""

    @classmethod
    def from_error(cls, exc: ProtocolError) -> RemoteProtocolError:
        """The same error, now blamed on the peer (for a check that ran on a received message)."""
        if isinstance(exc, RemoteProtocolError):
            return exc
        return cls(str(exc), what=exc.what, size=exc.size, limit=exc.limit, unit=exc.unit)


def _rebuild(cls: type[ProtocolError], message: str, what: str, size: int | None, limit: int | None,
             unit: str) -> ProtocolError:
    return cls(message, what=what, size=size, limit=limit, unit=unit)


class ConfigError(Exception):
    """The cluster configuration file is invalid; the message names key and file."""
