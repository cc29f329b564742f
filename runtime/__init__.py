"""The runtime, split by process. Imports point down only:

- :mod:`runtime.wire`: what both ends share (generated messages, framing, transport, channels).
- :mod:`runtime.daemon`: what a stage daemon runs (servicer, stage server, micro-batches, KV).
- :mod:`runtime.coordinator`: what drives a pipeline (deploy, sessions, the engine, recovery).
- :mod:`runtime.cluster`: starting, supervising and stopping daemons (and emulating a cluster).

Daemon and coordinator code never import each other: they meet only on the wire.
"""
