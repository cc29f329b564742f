"""hpipe's C++ CPU kernels (the ``.cpp`` sources here) and their Python faces: building and
loading the library (:mod:`.library`) and the process's prefill precision (:mod:`.precision`).
The bottom of ``hpipe.model``: imports nothing else of it."""
