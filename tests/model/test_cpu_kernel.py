"""The C++ decode kernel equals the eager micro-batch forward: every model family, packed and plain
projections, stages that start with an MLP or end with attention, sequences of different lengths,
one sliding past its window; and it takes only the micro-batches it can run."""

import dataclasses

import pytest
import torch

from hpipe.core.units import UnitRange, ranges_from_cuts
from hpipe.model.compute import stage_kernel
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels import library
from hpipe.model.kv.pool import Entry, KVPool
from hpipe.model.weights.sources import model_shape, resolve_model
from tests.helpers import FAMILIES, max_rel_diff, need_cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    need_cpu_kernels()  # setup.sh builds it; without that, it is built here if this machine can
    yield
    library.enable(True)
    library.vector_attention(True)


def _prefill(stages, pools, seqs, prompts):
    x = torch.cat(prompts)
    for j, stage in enumerate(stages):
        entries = []
        for row, p in zip(seqs, prompts):
            if row[j] is not None:
                row[j].grow(len(p))
            entries.append(Entry(0, len(p), row[j], "last"))
        x = stage.forward_batch(x, entries, pools[j])
    return x.argmax(-1)


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernel_equals_eager_decode(family, pack, vector, tiny_dirs, kernel):
    if pack and not torch.backends.mkl.is_available():
        pytest.skip("no MKL packed GEMM in this build")
    library.vector_attention(vector)
    source = resolve_model(str(tiny_dirs[family]))
    cfg, store = source.config, source.weights()
    # [embed, attn] / [mlp, attn, mlp] / [attn, mlp, head]
    stages = [StageModel.from_checkpoint(store, cfg, r, pack=pack) for r in ranges_from_cuts([2, 5], cfg.num_layers)]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (9, 4, 13, 1)]
    max_len = 30  # past mistral-sliding's window of 8
    runs = {}
    for kind in ("eager", "kernel"):
        library.enable(kind == "kernel")
        pools = [s.new_pool(40) for s in stages]
        seqs = [[p.sequence(max_len) for p in pools] for _ in prompts]
        tokens = _prefill(stages, pools, seqs, prompts)
        positions = [len(p) for p in prompts]
        logits = []
        for _ in range(max_len - max(positions)):
            x = tokens
            for j, stage in enumerate(stages):
                entries = []
                for row, pos in zip(seqs, positions):
                    row[j].grow(pos + 1)
                    entries.append(Entry(pos, 1, row[j], "last"))
                assert stage_kernel.fits(entries, pools[j])
                x = stage.forward_batch(x, entries, pools[j])
            logits.append(x)
            tokens = x.argmax(-1)
            positions = [p + 1 for p in positions]
        runs[kind] = torch.stack(logits)
        assert all((s._kernel is not None) == (kind == "kernel") for s in stages)
    assert max_rel_diff(runs["kernel"], runs["eager"]) <= 1e-5, family


@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (9, 3, 64),   # SmolLM2's shape: the loops' queries and sums in registers
    (8, 1, 64),   # a group of 8 queries per KV head: the general loops
    (4, 2, 16),   # a head of 16: the general loops
    (4, 2, 24),   # a head the loops do not take: MKL's products
])
def test_kernel_attention_equals_eager_for_every_head_shape(heads, kv_heads, head_dim, kernel):
    """Six sequences of 1-70 positions decoding through one attention unit: the kernel's output is
    the eager path's, whichever form its attention takes for the head shape."""
    library.vector_attention(True)
    cfg = dataclasses.replace(model_shape("random:tiny")[1], num_heads=heads, num_kv_heads=kv_heads,
                              head_dim=head_dim)
    stage = StageModel.random(cfg, UnitRange(1, 2, cfg.num_layers))  # the first attention unit alone
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 5, 17, 33, 64, 70]
    out = {}
    for on in (False, True):
        library.enable(on)
        pool = stage.new_pool(6 * 6)
        seqs = [pool.sequence(80) for _ in lengths]
        gen.manual_seed(7)
        prompt = torch.randn(sum(lengths), cfg.hidden_size, generator=gen)
        for s, n in zip(seqs, lengths):
            s.grow(n + 1)
        stage.forward_batch(prompt, [Entry(0, n, s) for s, n in zip(seqs, lengths)], pool)
        x = torch.randn(len(lengths), cfg.hidden_size, generator=gen)
        entries = [Entry(n, 1, s) for s, n in zip(seqs, lengths)]
        assert stage_kernel.fits(entries, pool)
        out[on] = stage.forward_batch(x, entries, pool)
    assert stage._kernel is not None
    assert max_rel_diff(out[True], out[False]) <= 1e-5


def test_kernel_takes_only_live_decode_tokens(kernel):
    pool = KVPool([0], 4, 2, 8, torch.float32, "cpu", block_size=4)
    seq = pool.sequence(8)
    seq.grow(5)
    assert stage_kernel.fits([Entry(4, 1, seq)], pool)
    assert not stage_kernel.fits([Entry(3, 2, seq)], pool)  # a prefill chunk
    assert not stage_kernel.fits([Entry(4, 1, seq), Entry(0, 1, None)], pool)  # a failed sequence's row
    assert not stage_kernel.fits([Entry(4, 1, seq)], None)  # a stage without attention
    assert not stage_kernel.fits([], pool)


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("family", ["llama", "mistral-sliding"])
def test_kernel_reads_shared_and_scattered_blocks(family, vector, tiny_dirs, kernel):
    """Sequences whose positions lie in several runs of slots: two that begin with a third's first
    blocks (a cached prefix, never written again), and one scattered by a full pool. The kernel's
    decode equals the eager path's, and the sharing sequences' logits equal those of a sequence that
    computed the whole prompt itself."""
    library.vector_attention(vector)
    source = resolve_model(str(tiny_dirs[family]))
    cfg = source.config
    stage = StageModel.from_checkpoint(source.weights(), cfg, UnitRange(0, 2 * cfg.num_layers + 2, cfg.num_layers))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (21,), generator=gen)
    steps = 12
    out = {}
    for kind in ("eager", "kernel"):
        library.enable(kind == "kernel")
        pool = stage.new_pool(40, block_size=4)
        donor = pool.sequence(21)
        donor.grow(21)
        stage.forward_batch(prompt, [Entry(0, 21, donor)], pool)
        sharers = []
        for cached in (16, 8):  # 4 and 2 blocks of the donor's, then blocks of their own
            seq = pool.sequence(40)
            seq.share(donor.blocks[:cached // 4])
            seq.grow(21)
            stage.forward_batch(prompt[cached:], [Entry(cached, 21 - cached, seq, "last")], pool)
            sharers.append(seq)
        whole = pool.sequence(4)  # declared short: the next block goes to another, so it scatters
        whole.grow(4)
        gap = pool.sequence(4)
        gap.grow(4)
        whole.max_len = 40
        whole.grow(21)
        first = stage.forward_batch(prompt, [Entry(0, 21, whole, "last")], pool)
        rows = [whole, *sharers]
        assert len(whole.runs(22)) > 1 and all(len(s.runs(22)) > 1 for s in sharers)
        donor.release()  # the sharers still hold its first blocks
        tokens, logits = first.argmax(-1).repeat(3), []
        for step in range(steps):
            entries = []
            for seq in rows:
                seq.grow(22 + step)
                entries.append(Entry(21 + step, 1, seq, "last"))
            assert stage_kernel.fits(entries, pool)
            x = stage.forward_batch(tokens, entries, pool)
            logits.append(x)
            tokens = x[0].argmax(-1).repeat(3)  # every row is fed the whole prompt's token
        out[kind] = torch.stack(logits)
        for seq in rows:
            seq.release()
        assert pool.used_blocks == 1  # the gap's; every shared block freed once its last holder let go
    assert max_rel_diff(out["kernel"], out["eager"]) <= 1e-5
    for k in range(1, 3):
        assert max_rel_diff(out["kernel"][:, k], out["kernel"][:, 0]) <= 1e-5


def test_switched_off_by_the_environment(kernel, monkeypatch):
    assert library.applies(torch.device("cpu"), torch.float32)
    assert not library.applies(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv(library.ENV, "off")
    assert not library.applies(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("vector", [True, False])
def test_smollm2_decode_step_through_the_kernel(smollm2, kernel, vector):
    """The real model, one sequence after a 40-token prompt: the kernel's logits are the eager ones."""
    library.vector_attention(vector)
    cfg = smollm2.config
    stage = StageModel.from_checkpoint(smollm2.weights(), cfg, UnitRange.full(cfg.num_layers))
    ids = torch.randint(0, cfg.vocab_size, (1, 41), generator=torch.Generator().manual_seed(5))
    out = {}
    for on in (False, True):
        library.enable(on)
        cache = stage.new_cache(1, 48)
        stage(ids[:, :40], 0, cache, logits=False)
        out[on] = stage(ids[:, 40:], 40, cache)[0, -1]
    assert stage._kernel is not None
    assert (out[True] - out[False]).abs().max() <= 1e-4 * out[False].abs().max()


def test_a_library_that_does_not_load_means_eager(tmp_path, monkeypatch):
    """A corrupt build in the cache is reported and skipped, not raised into a forward."""
    monkeypatch.setattr(library, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(library.torch.ops, "hpipe", type("NoOps", (), {})())
    (tmp_path / f"{library.name()}.so").write_bytes(b"not a shared library")
    library.available.cache_clear()
    try:
        assert not library.available()
    finally:
        library.available.cache_clear()


def test_missing_kernels_are_built_on_first_use_and_fail_loudly(tmp_path, monkeypatch, smollm2):
    """Not built yet: the first ask builds them; a build that cannot work leaves float32 stages
    eager and makes a quantized stage a clear error that names the way out, not a slow path."""
    from hpipe.core.errors import ModelSourceError
    from hpipe.core.units import UnitRange

    builds = []

    def no_compiler(verbose=False):
        builds.append(1)
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(library, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(library, "build", no_compiler)
    monkeypatch.setattr(library.torch.ops, "hpipe", type("NoOps", (), {})())
    library.available.cache_clear()
    try:
        assert not library.available() and builds == [1]
        cfg = smollm2.config
        with pytest.raises(ModelSourceError, match="c\\+\\+: command not found.*--dequantize"):
            StageModel.from_checkpoint(smollm2.weights(), cfg, UnitRange(0, 3, cfg.num_layers))
        StageModel.from_checkpoint(smollm2.weights(dequantize=True), cfg, UnitRange(0, 3, cfg.num_layers))
    finally:
        library.available.cache_clear()


def test_a_cpu_daemon_says_how_it_decodes(kernel, monkeypatch):
    from hpipe.app.daemon import _decode_path

    assert _decode_path("cuda:0") == ""
    assert "through the C++ kernel" in _decode_path("cpu")
    monkeypatch.setenv(library.ENV, "off")
    assert f"{library.ENV}=off" in _decode_path("cpu")


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_narrower_instruction_sets_decode_the_same(isa):
    """The attention loops of a CPU without AVX-512 (AVX2) and the MKL products of one without
    either give the eager path's results too, over one run of slots or several (HPIPE_CPU_ISA caps
    the choice on a wider CPU)."""
    import os
    import subprocess
    import sys

    flags = open("/proc/cpuinfo", encoding="utf-8").read() if os.path.exists("/proc/cpuinfo") else ""
    if isa == "avx2" and " avx2" not in flags:
        pytest.skip("this CPU has no AVX2")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "(test_kernel_equals_eager_decode and False-True) or reads_shared_and_scattered"],
                         capture_output=True, text=True, env=dict(os.environ, HPIPE_CPU_ISA=isa), timeout=600)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:]
