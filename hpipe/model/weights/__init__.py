"""Weights as files store them: GGUF and safetensors reading, the quantized block formats,
hpipe's own quantizer, model sources (built-in, Hugging Face directories, GGUF files, random
shapes) and their cache, and the manifests that ship weights to daemons. Below the compute;
above the kernels (blocks dequantize through them)."""
