"""Decode rows of K-quant weights in integers (kernels/q8_dot.cpp): x rounded per 256 values to 8
bits (ggml's Q8_K, ``HPIPE_DECODE_DOT=int8``) or to 15 bits (``int15``), integer dot products; and,
in ``int15``, of Q4_0, Q4_1 and Q8_0 parts whose rows hold 1,024 values or more
(kernels/legacy_dot.cpp: x in 15 bits per 32 values).
Exact against a float64 reference of that arithmetic, at the largest sums the blocks allow too; a
row's bits the same alone or among others, as a decode or beside prefill rows, and on every
instruction set; prefill rows and the head untouched. Fidelity on the real Gemma 3 270M
(docs/decisions/int8-decode.md): 15 bits within the rule, 8 bits not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpipe.model.generate.local import LocalModel, encode_prompt
from hpipe.model.weights.blocks import TYPES, QuantizedWeight, random_weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")

#: each integer mode and the largest magnitude x's values round to
TOPS = {"int8": 127, "int15": 16383}
#: how far from float64 a result may be, relative to the largest: the products are exact integers,
#: but each block's sums go to float32 once (2^-24 of them); with 15 bits they reach 2^27, and
#: Q4_K's and Q5_K's two float sums (values, minimums) cancel much of each other
CLOSE = {"int8": 1e-6, "int15": 3e-5}


@pytest.fixture(params=list(TOPS))
def dot(request):
    before = torch.ops.hpipe.decode_dot("")
    torch.ops.hpipe.decode_dot(request.param)
    yield request.param
    torch.ops.hpipe.decode_dot(before)

K_QUANTS = {name: t for t, (name, _, _) in TYPES.items() if name in ("Q4_K", "Q5_K", "Q6_K")}
TEXT = Path(__file__).parents[1] / "data" / "apache-2.0.txt"


def rounded(x: torch.Tensor, top: int) -> torch.Tensor:
    """``x`` as the decode rows see it: each 256 values scaled to [-top, top], rounded to integers
    (ties to even), scaled back (8 bits: ggml's Q8_K)."""
    blocks = x.reshape(x.shape[0], -1, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    iscale = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    d = torch.where(amax > 0, 1.0 / iscale, torch.zeros_like(amax))
    return (torch.round(blocks * iscale) * d).reshape(x.shape)


def decode(x, w, low=None):
    low = torch.zeros(x.shape[0], dtype=torch.bool) if low is None else low
    return torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0), low)


@pytest.mark.parametrize("name", list(K_QUANTS))
def test_decode_rows_are_exact_integer_products_whatever_shares_the_call(name, dot):
    g = torch.Generator().manual_seed(7)
    w = random_weight(K_QUANTS[name], 80, 1024, g)
    x = torch.randn(30, 1024, generator=g)
    dense = w.dequantize().double()
    for m in (1, 3, 13, 30):  # 30: past the rows where float32 rows go to a GEMM
        out = decode(x[:m], w)
        ref = rounded(x[:m], TOPS[dot]).double() @ dense.T
        assert float((out.double() - ref).abs().max() / ref.abs().max()) <= CLOSE[dot], m
        assert torch.equal(out, decode(x, w)[:m])  # the same bits among 30 rows
    alone = torch.cat([decode(x[i:i + 1], w) for i in range(30)])
    assert torch.equal(alone, decode(x, w))
    # beside prefill rows: those in the prefill precision, each decode row its own bits still
    low = torch.arange(30) % 3 == 0
    mixed = decode(x, w, low)
    assert torch.equal(mixed[~low], alone[~low])
    assert torch.equal(mixed[low], torch.ops.hpipe.qlinear(x[low], w.data, w.parts, torch.empty(0), None))


def _extreme_blocks(name: str) -> QuantizedWeight:
    """One row of 4 blocks whose every product is as large as the type allows: Q6_K's values all
    0 (-32 once offset) at scale -128, Q4_K's and Q5_K's all 15 or 31 at scale 63, minimum 63."""
    t = K_QUANTS[name]
    _, _, nbytes = TYPES[t]
    block = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    if name == "Q6_K":  # ql, qh zero; 16 scales of -128; d
        block[192:208] = 128
        block[208:210] = one
    else:  # d, dmin, 12 bytes of 6-bit scales and minimums (all 63), the values all ones
        block[0:2] = block[2:4] = one
        block[4:16] = 255
        block[16:] = 255
    return QuantizedWeight.of(t, 1, 1024, block.repeat(4))


@pytest.mark.parametrize("name", list(K_QUANTS))
def test_the_largest_sums_the_blocks_allow_stay_exact(name, dot):
    """Every lane of a block at its bound (15 bits: 32 x 32 x 128 x 16383 for Q6_K, just under
    2^31): the 32-bit sums the AVX2 loop wraps give the exact products still."""
    w = _extreme_blocks(name)
    dense = w.dequantize().double()
    for x in (torch.ones(1, 1024), -torch.ones(1, 1024), torch.ones(1, 1024) * torch.tensor([1.0, -1.0]).repeat(512)):
        ref = rounded(x, TOPS[dot]).double() @ dense.T
        out = decode(x, w).double()
        assert float((out - ref).abs().max() / ref.abs().max().clamp(min=1)) <= CLOSE[dot], (x[0, :2], out, ref)


def test_float32_decode_and_unmarked_rows_keep_float_activations(dot):
    g = torch.Generator().manual_seed(8)
    w = random_weight(K_QUANTS["Q4_K"], 48, 512, g)
    x = torch.randn(5, 512, generator=g)
    head = torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0), None)  # no rows marked: the head's way
    ref = x.double() @ w.dequantize().double().T
    assert float((head.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    before = torch.ops.hpipe.decode_dot("")
    torch.ops.hpipe.decode_dot("float32")
    try:
        assert torch.equal(decode(x, w), head)
    finally:
        torch.ops.hpipe.decode_dot(before)
    assert torch.ops.hpipe.decode_dot("") == dot and not torch.equal(decode(x, w), head)
    torch.ops.hpipe.decode_dot("float32")
    assert torch.ops.hpipe.decode_dot("") == "float32"  # the fixture restores the process's default
    with pytest.raises(RuntimeError, match="int8, int15 or float32"):
        torch.ops.hpipe.decode_dot("int4")


#: each type's decode rows, printed as their bytes' hex (run on the instruction set HPIPE_CPU_ISA caps)
BITS = """
import torch
from hpipe.model.kernels import library
from hpipe.model.weights.blocks import TYPES, random_weight
library.available()
g = torch.Generator().manual_seed(9)
legacy = ("Q4_0", "Q4_1", "Q8_0") if torch.ops.hpipe.decode_dot("") == "int15" else ()
for t, (name, _, _) in sorted(TYPES.items()):
    if name in ("Q4_K", "Q5_K", "Q6_K", *legacy):
        k = 768 if name.endswith("_K") else 1312  # 41 blocks of 32: five groups of 8 and one over
        w = random_weight(t, 40, k, g)
        x = torch.randn(6, k, generator=g)
        for m in (1, 6):
            out = torch.ops.hpipe.qlinear(x[:m], w.data, w.parts, torch.empty(0), torch.zeros(m, dtype=torch.bool))
            print(name, out.numpy().tobytes().hex())
"""


def test_every_instruction_set_gives_the_same_bits(dot):
    """AVX-512 CPUs run the AVX2 loop, other CPUs the scalar one: the same bits (a greedy answer
    must not change with the CPU it runs on)."""
    runs = {}
    for isa in ("", "portable"):
        env = {k: v for k, v in os.environ.items() if k != "HPIPE_CPU_ISA"}
        env = dict(env, HPIPE_DECODE_DOT=dot, **({"HPIPE_CPU_ISA": isa} if isa else {}))
        done = subprocess.run([sys.executable, "-c", BITS], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[isa] = done.stdout
    assert runs[""].count("\n") == (12 if dot == "int15" else 6) and runs[""] == runs["portable"]


def _teacher_forced(gemma3, dot: str) -> tuple[float, float, float]:
    """Teacher-forced decode of real text, one token a step (every row a decode row): integer
    products in mode ``dot`` against float32 activations on the same blocks; top-1 agreement and
    both perplexities."""
    ids = encode_prompt(gemma3.tokenizer(), TEXT.read_text(encoding="utf-8"), False)[:384]
    model = LocalModel(gemma3)

    def logits(mode: str) -> torch.Tensor:
        before = torch.ops.hpipe.decode_dot("")
        torch.ops.hpipe.decode_dot(mode)
        try:
            runner = model.open(len(ids))
            rows = [runner.prefill(torch.tensor([ids[:1]]), [1])]
            rows += [runner.step(t) for t in ids[1:-1]]
            return torch.stack([r.reshape(-1) for r in rows])
        finally:
            torch.ops.hpipe.decode_dot(before)

    ints, f32 = logits(dot), logits("float32")
    assert not torch.equal(ints, f32)  # the decode rows did go through the integer products
    target = torch.tensor(ids[1:])

    def ppl(x):
        return float(torch.nn.functional.cross_entropy(x.double(), target).exp())
    return float((ints.argmax(-1) == f32.argmax(-1)).float().mean()), ppl(ints), ppl(f32)


def test_gemma3_decodes_in_15_bits_within_the_fidelity_rule(gemma3):
    """Top-1 agreement >= 99% and perplexity within 1% (#40's rule): 99.7% and 0.006% when written."""
    agree, ppl, ppl_f32 = _teacher_forced(gemma3, "int15")
    assert agree >= 0.99, agree
    assert abs(ppl / ppl_f32 - 1) <= 0.01, (ppl, ppl_f32)


@pytest.mark.xfail(strict=True, reason="96.6% top-1 agreement with float32 decode on Gemma 3 270M (rule: "
                   "99%): why 8 bits are not hpipe's way (docs/decisions/int8-decode.md)")
def test_gemma3_decodes_in_8_bits_within_the_fidelity_rule(gemma3):
    agree, ppl, ppl_f32 = _teacher_forced(gemma3, "int8")
    assert agree >= 0.99, agree
    assert abs(ppl / ppl_f32 - 1) <= 0.01, (ppl, ppl_f32)


def test_the_heads_decode_rows_multiply_as_decode_rows_and_its_prefill_rows_in_float32(dot):
    """The LM head (a stage marks its QuantLinear ``head``): the rows of decode entries go through
    the integer products like every projection's decode rows; the last row of a prefill slice
    stays float32 (an 8B file's Q6_K head is a tenth of its bytes, a 1B file's a quarter)."""
    from hpipe.model.compute.linear import QuantLinear, prefill_rows

    g = torch.Generator().manual_seed(10)
    w = random_weight(K_QUANTS["Q6_K"], 64, 512, g)
    x = torch.randn(5, 512, generator=g)
    head = QuantLinear(w)
    head.head = True
    floats = torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0), None)
    for marks in ([False] * 5, [True] * 5, [True, False, False, True, False]):
        prefill = torch.tensor(marks)
        with prefill_rows(prefill):
            out = head(x)
        if prefill.any():
            assert torch.equal(out[prefill], torch.ops.hpipe.qlinear(x[prefill], w.data, w.parts, torch.empty(0), None))
        assert torch.equal(out[~prefill], decode(x, w)[~prefill])
        assert not torch.equal(out[~prefill], floats[~prefill]) or not (~prefill).any()
    assert torch.equal(head(x), floats)  # outside a stage's rows: float32, as before


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16"])
def test_float_decode_rows_of_every_type_are_the_same_bits_whatever_shares_the_call(name):
    """The block types decode rows multiply in float32 (SmolLM2's Q4_1, Gemma 3's Q5_0 and Q8_0
    tensors): a row's bits must not depend on how many rows share its call, one to forty (past the
    fused loop's few rows, past the GEMM's threshold), or a speculative entry that verifies several
    tokens of one sequence at once would answer other than one token at a time. The default
    decode mode (integer K-quants) marks every row a decode row."""
    t = next(t for t, (n, _, _) in TYPES.items() if n == name)
    g = torch.Generator().manual_seed(11)
    # 37 weight rows: the last tile's one row; k past AVX2's 512-value stretches, short of the
    # 1,024 from which Q4_0, Q4_1 and Q8_0 rows multiply in integers (tested below)
    w = random_weight(t, 37, 992, g)
    x = torch.randn(40, 992, generator=g)
    alone = torch.cat([decode(x[i:i + 1], w) for i in range(40)])
    ref = x.double() @ w.dequantize().double().T
    assert float((alone.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    # 3 and 4: AVX2's loop of one half of each 16 lanes at a time; from 5, its tiles of 3 weight
    # rows by 3 rows of x (6, 7, 8: whole tiles and one or two rows left over)
    for m in (2, 3, 4, 5, 6, 7, 8, 16, 40):
        assert torch.equal(decode(x[:m], w), alone[:m]), m


LEGACY = {name: t for t, (name, _, _) in TYPES.items() if name in ("Q4_0", "Q4_1", "Q8_0")}


def rounded32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as Q4_0, Q4_1 and Q8_0 decode rows see it: each 32 values scaled to [-16383, 16383],
    rounded to integers (ties to even), scaled back."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    iscale = torch.where(amax > 0, 16383 / amax, torch.zeros_like(amax))
    d = torch.where(amax > 0, 1.0 / iscale, torch.zeros_like(amax))
    return (torch.round(blocks * iscale) * d).reshape(x.shape)


@pytest.fixture
def int15():
    before = torch.ops.hpipe.decode_dot("")
    torch.ops.hpipe.decode_dot("int15")
    yield
    torch.ops.hpipe.decode_dot(before)


@pytest.mark.parametrize("k", [1056, 2048])  # 33 blocks (a last group of one), 64
@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_decode_rows_are_exact_integer_products_whatever_shares_the_call(name, k, int15):
    g = torch.Generator().manual_seed(12)
    w = random_weight(LEGACY[name], 37, k, g)
    x = torch.randn(30, k, generator=g)
    ref = rounded32(x).double() @ w.dequantize().double().T
    alone = torch.cat([decode(x[i:i + 1], w) for i in range(30)])
    assert float((alone.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    for m in (2, 3, 4, 5, 6, 9, 30):  # 4 rows of x a pass, and what is left over
        assert torch.equal(decode(x[:m], w), alone[:m]), m
    low = torch.arange(30) % 4 == 1  # beside prefill rows
    mixed = decode(x, w, low)
    assert torch.equal(mixed[~low], alone[~low])
    assert torch.equal(mixed[low], torch.ops.hpipe.qlinear(x[low], w.data, w.parts, torch.empty(0), None))


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_blocks_at_their_bounds_stay_exact(name, int15):
    """Every weight at its largest magnitude (Q8_0 -128, Q4_0 -8, Q4_1 15 with a minimum) against
    x at +-16383 after rounding: each block's integer (32 x 128 x 16383 for Q8_0) is exact."""
    t = LEGACY[name]
    _, _, nbytes = TYPES[t]
    block = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    block[0:2] = one
    if name == "Q4_1":
        block[2:4] = one
        block[4:] = 255
    else:
        block[2:] = 128 if name == "Q8_0" else 0
    w = QuantizedWeight.of(t, 1, 1024, block.repeat(32))
    dense = w.dequantize().double()
    for x in (torch.ones(1, 1024), -torch.ones(1, 1024), torch.tensor([1.0, -1.0]).repeat(512)[None]):
        ref = rounded32(x).double() @ dense.T
        assert float((decode(x, w).double() - ref).abs().max() / ref.abs().max().clamp(min=1)) <= 1e-6, (name, x[0, :2])


def test_short_legacy_rows_keep_float32_decode(int15):
    """Rows of fewer than 1,024 values (SmolLM2's 576-wide projections) multiply in float32: there
    the integers were no faster (kernels/legacy_dot.cpp)."""
    g = torch.Generator().manual_seed(13)
    w = random_weight(LEGACY["Q4_1"], 16, 576, g)
    x = torch.randn(3, 576, generator=g)
    torch.ops.hpipe.decode_dot("float32")
    floats = decode(x, w)
    torch.ops.hpipe.decode_dot("int15")
    assert torch.equal(decode(x, w), floats)
    long = random_weight(LEGACY["Q4_1"], 16, 1024, g)
    y = torch.randn(3, 1024, generator=g)
    torch.ops.hpipe.decode_dot("float32")
    floats = decode(y, long)
    torch.ops.hpipe.decode_dot("int15")
    assert not torch.equal(decode(y, long), floats)


def test_smollm2_decodes_in_15_bits_within_the_fidelity_rule(smollm2):
    """SmolLM2's Q4_1 file: its down projections (1,536 values a row) and none of its 576-wide
    ones multiply in integers; #40's rule against float32 decode on the same blocks."""
    agree, ppl, ppl_f32 = _teacher_forced(smollm2, "int15")
    assert agree >= 0.99, agree
    assert abs(ppl / ppl_f32 - 1) <= 0.01, (ppl, ppl_f32)
