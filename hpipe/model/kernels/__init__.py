"""C++ sources of the CPU kernels (:mod:`hpipe.model.cpu_kernel` builds and loads them)."""
