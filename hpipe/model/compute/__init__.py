"""The model's compute: units (embedding, attention, MLP, head), the linear layers over
quantized, dequantized and MKL-packed weights, RoPE, a stage of units and its micro-batches,
the C++ decode step's Python face, CUDA graphs. Above weights, KV and the kernels."""
