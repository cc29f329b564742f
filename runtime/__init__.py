"""The runtime: gRPC stage daemons, the wire format, cluster files, the launcher and the coordinator."""
