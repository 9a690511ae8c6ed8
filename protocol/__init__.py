"""The wire contract shared by bps-server, bps-worker and the client library.

Nothing in this package performs I/O: it turns bytes into typed messages and back
(``frames``, ``messages``), knows the supported tensor dtypes (``dtypes``) and
reads and validates the cluster configuration (``config``).
"""

PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION"]
