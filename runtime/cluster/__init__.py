"""Daemons as processes: the launcher, the supervisor, and emulated clusters (namespaces, cgroups, MPS)."""
