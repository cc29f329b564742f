"""The model on one device: ``kernels`` (C++ and their faces) at the bottom, then ``weights``
(formats, sources) and ``kv`` (the cache), ``compute`` (units, stages) above them, ``generate``
(text in one process) on top. Each imports only those below it (tests/test_layers.py)."""
