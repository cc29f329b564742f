"""Plain-PyTorch forward of Llama-family models as a chain of units (the gpt-fast way)."""

from hpipe.model.kvcache import StageCache
from hpipe.model.stage import StageModel

__all__ = ["StageCache", "StageModel"]
