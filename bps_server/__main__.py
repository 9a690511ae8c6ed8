from bps_runtime.commands import bps_server

bps_server()
