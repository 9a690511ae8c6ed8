from bps_runtime.commands import bps_worker

bps_worker()
