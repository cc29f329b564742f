"""GPU checks: run where CUDA is present, skipped cleanly without it."""

import pytest
import torch

from hpipe.model import StageModel
from hpipe.sources import resolve_model
from hpipe.units import ranges_from_cuts
from tests.helpers import hf_model, max_rel_diff, run_split

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_stages_match_hf(tiny_dirs, dtype):
    src = resolve_model(str(tiny_dirs["llama3-rope"]))
    cfg, store = src.config, src.weights()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(src.path)(ids).logits
    stages = [StageModel.from_checkpoint(store, cfg, r, dtype=dtype, device="cuda")
              for r in ranges_from_cuts([2, 5], cfg.num_layers)]
    ours = run_split(stages, ids.cuda(), [5, 1, 18], max_len=24).cpu()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    # TF32 may be on for float32 matmuls: compare at a looser tolerance than the CPU's.
    assert max_rel_diff(ours, ref) <= (1e-3 if dtype == torch.float32 else tol)
