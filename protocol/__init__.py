"""The wire contract shared by bps-server, bps-worker and the client library.

Nothing in this package performs I/O: it turns bytes into typed messages and back
(``frames``, ``messages``), runs the connection handshake of every transport as
pure steps (``handshake``), knows the supported tensor dtypes (``dtypes``) and
reads and validates the cluster configuration (``config``).
"""

# 2: mutual handshake proofs, placement digest. 3: Push/Op root and layout, Push.holds_root, Hello.daemon,
# Announce, Alloc.free, Welcome.arena_bytes. 4: asynchronous mode: Push/Op kinds async_init and async,
# Push.staleness and Push.applied (a replayed value's vector), Result.applied, Op.staleness, Restored. 5: fused
# small sums: OpBatch, DoneBatch, FuseReady, FuseAbort, FusePlan (groups, epoch), FuseRunning, FuseResync,
# FuseFailed (epoch); Welcome.fusion_bytes. 6: lane generations: FusePlan.lanes and FuseRunning.lanes, and the
# fused tensors' names carry theirs (a version-5 worker would sum on lanes the anchor no longer runs). 7:
# Failure.auth (a refusal at the handshake proves the token); Taken (a client mapped the results its Dones named;
# a version-6 worker would refuse it as an unknown message). 8: Notice (stall lines told to the processes and
# workers that wait; a version-7 client or worker would refuse it as an unknown message). 9: Hello.server and
# Welcome.server, under the proofs (a version-8 peer drops the field it does not know, and each side's proof
# would cover other bytes: "a wrong proof" instead of the version mismatch). 10: Hello.fresh (a worker's numbering
# is unused: a restarted server places a machine that came back meanwhile at its peers' round; under the proofs).
# 11: RoundQuery.given_up (a version-10 server would drop it and place the round as one to join: after a failed
# round, the next one, which the rejoining machine's next step takes too). 12: Hello.processes and Joined (a daemon
# idle since it started is one without processes; a version-11 server would wait for its processes for ever).
# 13: Leave (a client's shutdown answered once it took effect; a version-12 worker would refuse it as unknown), and
# Reset on every connection of a worker (a version-12 server would reset the worker again at each). 14: InitFailed
# (the root's machine failed an async_init before pushing it; a version-13 server would refuse it as unknown).
# 15: Hello.job, Hello.job_age_s, Joined.job, Joined.job_age_s and Push.job (a version-14 server would drop them
# and take the next job's async_init for a rejoin of the last one's value).
PROTOCOL_VERSION = 15

__all__ = ["PROTOCOL_VERSION"]
