"""Kept so that ``python -m bps_server.timeline merge ...`` still works; the module is :mod:`bps_runtime.timeline`."""

from bps_runtime.timeline import *  # noqa: F401,F403
from bps_runtime.timeline import main

if __name__ == "__main__":
    raise SystemExit(main())
