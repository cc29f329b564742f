"""The contracts every other package builds on, and which import none of them.

Errors, the model as a chain of units, the model's config (one serialisation), cluster files and
daemon options, the profile and the plan schemas, built-in model shapes, the cache folder. Pure
Python: no torch, no gRPC.
"""
