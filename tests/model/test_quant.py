"""GGUF's quantized blocks: the kernels against the gguf package's own dequantization, on every
instruction set this CPU has, and the real SmolLM2 Q4_1 file against its float32 import."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hpipe.core.errors import ModelSourceError
from hpipe.core.units import UnitRange, ranges_from_cuts
from hpipe.model.compute.layers import checkpoint_tensors
from hpipe.model.compute.linear import QuantEmbedding, QuantLinear
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import LocalModel, encode_prompt, generate
from hpipe.model.kernels.precision import set_prefill_gemm
from hpipe.model.weights.blocks import TYPES, QuantizedWeight
from hpipe.model.weights.gguf import INDEX, GGUFWeights, head_order
from tests.helpers import max_rel_diff

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # a failure under CI without them

#: real text no other test reads (the Apache License 2.0, verbatim: 2,224 SmolLM2 tokens)
TEXT = Path(__file__).parents[1] / "data" / "apache-2.0.txt"

#: a program that checks every type at several row counts on the instruction set HPIPE_CPU_ISA caps
CHECK = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from gguf import GGMLQuantizationType as T, quants
    from hpipe.model.kernels import library
    from hpipe.model.weights.blocks import TYPES, QuantizedWeight
    assert library.available()
    rng = np.random.default_rng(0)
    rows, width, report = 40, 512, {"isa": torch.ops.hpipe.quant_variant()}

    def blocks(t):
        w = rng.standard_normal((rows, width)).astype(np.float32)
        try:
            return np.ascontiguousarray(quants.quantize(w, t)).view(np.uint8).reshape(rows, -1)
        except NotImplementedError:  # the K-quants: random blocks with small scales
            _, values, nbytes = TYPES[int(t)]
            raw = rng.integers(0, 256, size=(rows, width // values, nbytes), dtype=np.uint8)
            scale = np.array([0.01, 0.003], dtype=np.float16).view(np.uint8)
            if t == T.Q6_K:
                raw[:, :, 208:210] = scale[:2]  # its d
            else:
                raw[:, :, 0:4] = scale  # d and dmin
            return raw.reshape(rows, -1)

    for t in [T(i) for i in TYPES]:
        raw = blocks(t)
        ref = torch.from_numpy(quants.dequantize(raw, t).reshape(rows, width).astype(np.float32))
        w = QuantizedWeight.of(int(t), rows, width, torch.from_numpy(raw).reshape(-1))
        worst = 0.0
        for m in (1, 3, 4, 5, 16, 23, 24, 40):
            x = torch.randn(m, width)
            out = torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0))
            expect = x @ ref.T
            worst = max(worst, float((out - expect).abs().max() / expect.abs().max()))
        report[t.name] = {"exact": bool(torch.equal(w.dequantize(), ref)), "rel": worst}
    print(json.dumps(report))
""")


def _cpu_has(flag: str) -> bool:
    """Whether the CPU has ``flag`` as hpipe's kernels see it: ``HPIPE_CPU_ISA=avx2`` (the tests'
    AVX2 pass, scripts/test.sh) hides AVX-512, ``portable`` AVX2 too."""
    cap = os.environ.get("HPIPE_CPU_ISA", "")
    if (cap in ("avx2", "portable") and flag.startswith("avx512")) or (cap == "portable" and flag.startswith("avx")):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_every_type_on_every_instruction_set(isa):
    """Dequantization is ggml's bit for bit, and products equal float32 ones over the dequantized
    matrix (1e-5), through both paths (per-row dots under 24 rows, panels and GEMM from 24)."""
    if isa == "avx512" and not _cpu_has("avx512bw"):
        pytest.skip("this CPU has no AVX-512")
    if isa == "avx2" and not _cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, HPIPE_CPU_ISA=isa, HPIPE_PREFILL_GEMM="float32")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report.pop("isa") == isa
    assert set(report) == {v[0] for v in TYPES.values()}
    for name, r in report.items():
        assert r["exact"], name
        assert r["rel"] <= 1e-5, (name, r)


def test_parts_of_different_types_stack():
    """A fused projection whose pieces the file stores in different types (Q4_K_M keeps some
    value projections at Q6_K) computes each piece from its own blocks."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(1)
    pieces, dense = [], []
    for t, rows in ((T.Q4_0, 48), (T.Q8_0, 16), (T.Q8_0, 16), (T.Q4_1, 8)):
        w = rng.standard_normal((rows, 256)).astype(np.float32)
        raw = torch.from_numpy(quants.quantize(w, t).reshape(-1))
        pieces.append(QuantizedWeight.of(int(t), rows, 256, raw))
        dense.append(pieces[-1].dequantize())
    stacked = QuantizedWeight.stack(pieces)
    assert stacked.type_names == ["Q4_0", "Q8_0", "Q4_1"]  # the two Q8_0 pieces are one part
    layer = QuantLinear(stacked, bias=torch.arange(88, dtype=torch.float32))
    for m in (1, 7, 64):
        x = torch.randn(m, 256)
        assert max_rel_diff(layer(x), x @ torch.cat(dense).T + torch.arange(88.0)) <= 1e-5
    embed = QuantEmbedding(pieces[0])
    ids = torch.tensor([[0, 47, 3]])
    assert torch.equal(embed(ids), dense[0][ids])
    with pytest.raises(RuntimeError, match="outside the table"):
        embed(torch.tensor([48]))


def test_head_order_undoes_the_converters_permutation():
    """llama.cpp's converter (convert_hf_to_gguf.py's permute) and our order are inverses."""
    rows, heads = 48, 3
    hf = torch.arange(rows * 2).reshape(rows, 2)
    converted = hf.reshape(heads, 2, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows, 2)
    assert torch.equal(converted[head_order(rows, heads)], hf)


def test_an_unsupported_type_names_the_tensor(smollm2, tmp_path):
    index = json.loads((smollm2.path / INDEX).read_text())
    index["tensors"]["model.layers.0.mlp.down_proj.weight"]["type"] = 10  # Q2_K
    (tmp_path / INDEX).write_text(json.dumps(index))
    store = GGUFWeights(smollm2.gguf, tmp_path / INDEX, smollm2.config)
    with pytest.raises(ModelSourceError, match=r"blk\.0\.ffn_down\.weight is stored as ggml type Q2_K"):
        StageModel.from_checkpoint(store, smollm2.config, UnitRange(0, 4, smollm2.config.num_layers))


def test_stage_holds_the_files_bytes(smollm2):
    """A stage's weights are the GGUF bytes of its units' tensors (within 10%; the float32 norms
    are the same bytes either way), not a float32 copy."""
    cfg, store = smollm2.config, smollm2.weights()
    assert isinstance(store, GGUFWeights)
    for units in ranges_from_cuts([7, 40], cfg.num_layers):
        stage = StageModel.from_checkpoint(store, cfg, units)
        names = {n for u in units for n in checkpoint_tensors(cfg, u)}
        stored = sum(store.nbytes(n) for n in names)
        assert abs(stage.weight_bytes() - stored) <= 0.1 * stored, units
        assert stage.weight_bytes() < 0.3 * stage.parameter_count() * 4


def test_quantized_equals_dequantized_smollm2(smollm2):
    """The Q4_1 blocks computed as stored give the float32 import's logits (1e-4, activations stay
    float32) and its greedy tokens, whole and cut inside blocks with sliced prefill."""
    tok = smollm2.tokenizer()
    reference = LocalModel(smollm2, dequantize=True)
    for cuts in ((), (5, 33, 61)):
        quantized = LocalModel(smollm2, cuts=cuts)
        assert any(isinstance(m, QuantLinear) for s in quantized.stages for m in s.modules())
        for prompt in ("Summarise the causes of the French Revolution in three sentences.",
                       "def fibonacci(n):\n    "):
            a = generate(quantized.open, tok, prompt, context=2048, eos_ids=[], max_new_tokens=24,
                         slices=[5, len(encode_prompt(tok, prompt, False)) - 5])
            b = generate(reference.open, tok, prompt, context=2048, eos_ids=[], max_new_tokens=24)
            assert a.token_ids == b.token_ids, (cuts, prompt)
        ids = torch.tensor([encode_prompt(tok, "The committee met on Tuesday to decide", False)])
        ours, ref = quantized.open(ids.shape[1]), reference.open(ids.shape[1])
        assert max_rel_diff(ours.prefill(ids, [ids.shape[1]]), ref.prefill(ids, [ids.shape[1]])) <= 1e-4


@pytest.fixture
def bfloat16_prefill():
    """Prefill slices of quantized weights in bfloat16 for the test (skipped where the CPU has no
    bfloat16 GEMM); float32 again after it."""
    try:
        before = set_prefill_gemm("bfloat16")
    except ModelSourceError as e:
        pytest.skip(str(e))
    yield
    set_prefill_gemm(before)


def test_the_bfloat16_prefill_gemm_is_the_rounded_product(bfloat16_prefill):
    """The rows marked as prefill's multiply as the float32 sum of the bfloat16-rounded activations
    and dequantized weights (to float32's summation error), in every part of a stacked weight,
    however many they are; the other rows, and every row with float32 chosen again, stay float32's.
    A row's result does not depend on the rows beside it (bit for bit from two rows up)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(2)
    pieces = []
    for t, rows in ((T.Q4_1, 40), (T.Q8_0, 24), (T.Q5_0, 8)):
        w = rng.standard_normal((rows, 256)).astype(np.float32)
        pieces.append(QuantizedWeight.of(int(t), rows, 256, torch.from_numpy(quants.quantize(w, t).reshape(-1))))
    weight = QuantizedWeight.stack(pieces)
    dense = weight.dequantize()
    rounded = dense.bfloat16().float()
    assert not torch.equal(rounded, dense)  # so the checks below tell the two apart

    def product(x, low=None):
        return torch.ops.hpipe.qlinear(x, weight.data, weight.parts, torch.empty(0), low)

    def every(n):
        return torch.ones(n, dtype=torch.bool)

    x = torch.randn(40, 256)
    low = torch.arange(40) % 3 > 0  # rows of prefill slices among decode tokens
    assert max_rel_diff(product(x, every(40)), x.bfloat16().float() @ rounded.T) <= 1e-5
    assert max_rel_diff(product(x), x @ dense.T) <= 1e-5  # unmarked: float32, however many rows
    mixed = product(x, low)
    assert max_rel_diff(mixed[low], x[low].bfloat16().float() @ rounded.T) <= 1e-5
    assert max_rel_diff(mixed[~low], x[~low] @ dense.T) <= 1e-5
    assert max_rel_diff(product(x, every(40)), x @ dense.T) > 1e-4
    for n in (1, 2, 8, 13):  # a few prefill rows are bfloat16 too, the same bits as among 40
        assert torch.equal(product(x[:n], every(n)), product(x, every(40))[:n]), n
    set_prefill_gemm("float32")
    assert max_rel_diff(product(x, every(40)), x @ dense.T) <= 1e-5


def test_hpipes_own_bfloat16_gemm_wherever_the_cpu_has_avx512_bf16():
    """hpipe's own bfloat16 GEMM (kernels/bf16_gemm.cpp; what an AMD CPU with AVX512-BF16 uses,
    where MKL's is not in hardware) passes the rounded-product test on an Intel CPU too, where
    MKL's is the default: HPIPE_BF16_GEMM=hpipe asks for it."""
    if not _cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16")
    env = dict(os.environ, HPIPE_BF16_GEMM="hpipe")
    which = subprocess.run([sys.executable, "-c", "from hpipe.model.kernels import library; import torch; "
                            "library.available(); print(torch.ops.hpipe.bf16_gemm_kernel())"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert which.stdout.split()[-1:] == ["hpipe"], which.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::"
                          "test_the_bfloat16_prefill_gemm_is_the_rounded_product"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).parents[2])
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_bfloat16_prefill_agrees_with_the_dequantized_model(smollm2, bfloat16_prefill):
    """The bar for a kernel that rounds activations: over 2,048 positions of real text, read in
    slices of 512, teacher-forced top-1 agreement with the --dequantize model of at least 99% and
    a perplexity within 1% of its."""
    ids = torch.tensor([smollm2.tokenizer()(TEXT.read_text())["input_ids"][:2049]])
    targets = ids[0, 1:]

    def logits(model):
        stage = model.stages[0]
        cache = stage.new_cache(1, 2048)
        with torch.no_grad():
            return torch.cat([stage(ids[:, s:s + 512], s, cache, all_logits=True)[0] for s in range(0, 2048, 512)])

    reference, ours = logits(LocalModel(smollm2, dequantize=True)), logits(LocalModel(smollm2))
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    ppl = [torch.nn.functional.cross_entropy(x, targets).exp().item() for x in (ours, reference)]
    assert agree >= 0.99, agree
    assert abs(ppl[0] / ppl[1] - 1) <= 0.01, ppl
    assert agree < 1.0 or ppl[0] != ppl[1]  # the rounding is in effect: not the float32 model again


def test_bfloat16_prefill_does_not_depend_on_the_slicing(smollm2, bfloat16_prefill):
    """However a prompt is sliced (the plan's slices, gLLM's load-dependent budget, a recovery's
    replay, a prefix cache's hit), every position's hidden state is the same bits: the GEMM rounds
    rows alone and the attention splits keys at fixed positions (layers.Attention._attend_split).
    Unaligned slices, slices of two tokens and of one (a prompt's rows are prefill rows whatever
    their number: ``prefill=True``) and cuts of the model included; compared where the head takes
    them (the float32 head's sums differ by an ulp between a few rows and many)."""
    ids = torch.tensor([smollm2.tokenizer()(TEXT.read_text())["input_ids"][:1500]])
    cfg = smollm2.config
    model = LocalModel(smollm2, cuts=(23, 40, cfg.num_units - 1))

    def hidden(slices):
        runner, out, start = model.open(ids.shape[1]), [], 0
        for n in slices:
            x = ids[:, start:start + n]
            for stage, cache in zip(runner.stages[:-1], runner.caches):
                x = stage(x, start, cache, prefill=True)
            out.append(x[0])
            start += n
        return torch.cat(out)

    reference = hidden([1500])
    for slices in ([512, 512, 476], [700, 800], [2, 1030, 468], [448, 560, 492], [1, 1499], [700, 1, 799],
                   [1499, 1]):
        assert torch.equal(hidden(slices), reference), slices
    runner = model.open(ids.shape[1])  # the generation loop's prefill says so too
    assert torch.equal(runner.prefill(ids, [1499, 1]), model.open(ids.shape[1]).prefill(ids, [1500]))
