"""The KV cache: a stage's pool of blocks, its sequences, micro-batch entries, and the
single-process caches built on it. Depends on nothing else of the model."""
