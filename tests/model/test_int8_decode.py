"""Decode rows of K-quant weights as ggml computes them (kernels/q8_dot.cpp; an experiment, off
unless HPIPE_DECODE_DOT=int8): x rounded to 8 bits per 256 values, integer dot products. Exact
against a float64 reference of that arithmetic; a row's bits the same alone or among others, as a
decode or beside prefill rows, and on every instruction set; prefill rows and the head
untouched. Not yet within the fidelity rule on the real Gemma 3 270M (docs/decisions/int8-decode.md):
why it is off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpipe.model.generate import LocalModel, encode_prompt
from hpipe.model.quant import TYPES, random_weight

pytestmark = pytest.mark.usefixtures("cpu_kernels", "int8")


@pytest.fixture
def int8():
    before = torch.ops.hpipe.decode_dot("")
    torch.ops.hpipe.decode_dot("int8")
    yield
    torch.ops.hpipe.decode_dot(before)

K_QUANTS = {name: t for t, (name, _, _) in TYPES.items() if name in ("Q4_K", "Q5_K", "Q6_K")}
TEXT = Path(__file__).parents[1] / "data" / "apache-2.0.txt"


def rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the decode rows see it: each 256 values scaled to [-127, 127], rounded to integers
    (ties to even), scaled back (ggml's Q8_K)."""
    blocks = x.reshape(x.shape[0], -1, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    iscale = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d = torch.where(amax > 0, 1.0 / iscale, torch.zeros_like(amax))
    return (torch.round(blocks * iscale) * d).reshape(x.shape)


def decode(x, w, low=None):
    low = torch.zeros(x.shape[0], dtype=torch.bool) if low is None else low
    return torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0), low)


@pytest.mark.parametrize("name", list(K_QUANTS))
def test_decode_rows_are_exact_integer_products_whatever_shares_the_call(name):
    g = torch.Generator().manual_seed(7)
    w = random_weight(K_QUANTS[name], 80, 1024, g)
    x = torch.randn(30, 1024, generator=g)
    dense = w.dequantize().double()
    for m in (1, 3, 13, 30):  # 30: past the rows where float32 rows go to a GEMM
        out = decode(x[:m], w)
        ref = rounded(x[:m]).double() @ dense.T
        assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-6, m
        assert torch.equal(out, decode(x, w)[:m])  # the same bits among 30 rows
    alone = torch.cat([decode(x[i:i + 1], w) for i in range(30)])
    assert torch.equal(alone, decode(x, w))
    # beside prefill rows: those in the prefill precision, each decode row its own bits still
    low = torch.arange(30) % 3 == 0
    mixed = decode(x, w, low)
    assert torch.equal(mixed[~low], alone[~low])
    assert torch.equal(mixed[low], torch.ops.hpipe.qlinear(x[low], w.data, w.parts, torch.empty(0), None))


def test_float32_decode_and_unmarked_rows_keep_float_activations():
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
    assert torch.ops.hpipe.decode_dot("") == "int8" and not torch.equal(decode(x, w), head)
    torch.ops.hpipe.decode_dot("float32")
    assert torch.ops.hpipe.decode_dot("") == "float32"  # the fixture restores the process's default
    with pytest.raises(RuntimeError, match="int8 or float32"):
        torch.ops.hpipe.decode_dot("int4")


#: each type's decode rows, printed as their bytes' hex (run on the instruction set HPIPE_CPU_ISA caps)
BITS = """
import torch
from hpipe.model import cpu_kernel
from hpipe.model.quant import TYPES, random_weight
cpu_kernel.available()
g = torch.Generator().manual_seed(9)
for t, (name, _, _) in sorted(TYPES.items()):
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        w = random_weight(t, 40, 768, g)
        x = torch.randn(6, 768, generator=g)
        out = torch.ops.hpipe.qlinear(x, w.data, w.parts, torch.empty(0), torch.zeros(6, dtype=torch.bool))
        print(name, out.numpy().tobytes().hex())
"""


def test_every_instruction_set_gives_the_same_bits():
    """AVX-512 CPUs run the AVX2 loop, other CPUs the scalar one: the same bits (a greedy answer
    must not change with the CPU it runs on)."""
    runs = {}
    for isa in ("", "portable"):
        env = {k: v for k, v in os.environ.items() if k != "HPIPE_CPU_ISA"}
        env = dict(env, HPIPE_DECODE_DOT="int8", **({"HPIPE_CPU_ISA": isa} if isa else {}))
        done = subprocess.run([sys.executable, "-c", BITS], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[isa] = done.stdout
    assert runs[""].count("\n") == 3 and runs[""] == runs["portable"]


@pytest.mark.xfail(strict=True, reason="96.1% top-1 agreement with float32 decode on Gemma 3 270M (rule: "
                   "99%): why HPIPE_DECODE_DOT=int8 is off by default (docs/decisions/int8-decode.md)")
def test_gemma3_decodes_within_the_fidelity_rule(gemma3):
    """Teacher-forced decode of real text, one token a step (every row a decode row): integer
    products against float32 activations on the same blocks, top-1 agreement >= 99% and
    perplexity within 1%. Not met yet: strictly expected to fail, so a change that meets it
    says so."""
    ids = encode_prompt(gemma3.tokenizer(), TEXT.read_text(encoding="utf-8"), False)[:384]
    model = LocalModel(gemma3)

    def logits() -> torch.Tensor:
        runner = model.open(len(ids))
        rows = [runner.prefill(torch.tensor([ids[:1]]), [1])]
        rows += [runner.step(t) for t in ids[1:-1]]
        return torch.stack([r.reshape(-1) for r in rows])

    int8 = logits()
    before = torch.ops.hpipe.decode_dot("")
    torch.ops.hpipe.decode_dot("float32")
    try:
        f32 = logits()
    finally:
        torch.ops.hpipe.decode_dot(before)
    target = torch.tensor(ids[1:])
    agree = float((int8.argmax(-1) == f32.argmax(-1)).float().mean())

    def ppl(x):
        return float(torch.nn.functional.cross_entropy(x.double(), target).exp())
    assert agree >= 0.99, agree
    assert abs(ppl(int8) / ppl(f32) - 1) <= 0.01, (ppl(int8), ppl(f32))
    assert not torch.equal(int8, f32)  # the decode rows did go through the integer products
