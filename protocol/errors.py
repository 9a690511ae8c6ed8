"""Errors raised by the protocol package, split by whose fault they are."""


class ProtocolError(Exception):
    """The peer sent something that breaks the protocol (bad frame, bad message).

    After this error the connection it came from must be closed: the byte
    stream can no longer be trusted.
    """


class LocalProtocolError(Exception):
    """Our own side tried to send something the protocol does not allow."""


class ConfigError(Exception):
    """The cluster configuration file is invalid; the message names key and file."""
