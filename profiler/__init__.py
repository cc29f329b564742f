"""Profiling: what each device computes how fast, what it can hold, and what each link carries."""
