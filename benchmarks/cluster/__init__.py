"""A cluster emulator for one box: network namespaces as machines, tc-shaped links, our daemons inside.

- :mod:`.netns`: :class:`Network` (namespaces, veth pairs, bridge, tbf shapers; always torn down),
  :func:`unavailable_reason`, :func:`cleanup_stale`.
- :mod:`.daemons`: :class:`Layout` (which machine runs what), :func:`write_config` (the cluster TOML),
  :class:`Daemons` (``bps-server`` / ``bps-worker`` inside the namespaces, readiness over NOTIFY_SOCKET).

Root only. Used by ``benchmarks/paper_vs_allreduce.py`` and ``tests/daemons/test_emulator.py``.
"""

from .daemons import Daemons, Layout, write_config
from .netns import (
    EmulatorError,
    EmulatorUnavailable,
    Machine,
    Network,
    cleanup_stale,
    our_namespaces,
    parse_rate,
    require_available,
    unavailable_reason,
)

__all__ = [
    "Daemons", "Layout", "write_config", "EmulatorError", "EmulatorUnavailable", "Machine", "Network",
    "cleanup_stale", "our_namespaces", "parse_rate", "require_available", "unavailable_reason",
]
