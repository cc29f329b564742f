"""hpipe: one LLM pipelined across mismatched devices, sliced along the token dimension.

The flow is profile -> plan -> run:

- ``hpipe.model``: the model as a chain of units (embed, attn_i, mlp_i, head) in plain PyTorch;
- ``hpipe.model.weights.sources``: where weights, config and tokenizer come from (HF dir, GGUF, built-ins);
- ``hpipe.model.generate.local``: single-process generation, the reference the pipeline must equal;
- ``profiler``, ``planner``, ``runtime``: measuring devices, choosing cuts and slices, running.
"""

__version__ = "0.1.0"
