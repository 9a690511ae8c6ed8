"""bps-worker: the Communication Service, plus the client libraries that talk to it.

``bps_worker.client`` is the numpy API for any framework; ``bps_worker.torch`` the
PyTorch layer. Importing this package does nothing.
"""
