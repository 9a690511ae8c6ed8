"""bps-server: the Summation Service. It only sums; see ``bps_server.main``."""
