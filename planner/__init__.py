"""Planning (pure: no torch, no I/O): layer cuts, token slicing, and a pipeline simulator.

``plan(profile, workload)`` returns a :class:`hpipe.core.plan.Plan` for hpipe and each baseline.
"""
