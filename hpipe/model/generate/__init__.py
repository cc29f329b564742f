"""Text in one process: prompts, sampling, and the local generation loop over stages. The top
of ``hpipe.model``."""
