"""Moved: the worker's link to a server is ``bps_worker.link`` (its send window ``bps_worker.window``)."""

from .link import ServerLink  # noqa: F401
