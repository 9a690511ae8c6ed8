"""The runtime that both daemons and the client libraries stand on.

``kernels`` (numba summation), ``segments`` (POSIX shared memory: the worker's arena, everyone else attaches),
``cuda`` (CUDA IPC between training processes and the worker), ``lowat`` (the TCP receive low-water mark),
``timeline`` (Chrome-trace timelines), ``metrics`` (the HTTP endpoint of ``/metrics`` through prometheus_client,
``/livez`` and ``/readyz``), ``health`` (the probes' decisions and the loop's pulse: systemd's watchdog and
status), ``lifecycle`` (a daemon's logging, event loop, signals and systemd readiness) and ``forkserver``
(daemons forked from one process that imported them once: the tests' clusters). Of the project it
imports only ``protocol``; importing it does nothing.
"""
