"""A device's fingerprint (what its cached profile grids are keyed by) names everything that sets
its speed: a CPU capped at AVX2 (scripts/avx2.env), or decoding in integers (HPIPE_DECODE_DOT),
computes with other kernels, so it never shares a grid with one that does not (a capped run
planned from an uncapped profile mispredicts)."""

import torch

from profiler.device import KERNEL_ENV, fingerprint


def test_an_instruction_set_cap_changes_the_fingerprint(monkeypatch):
    for k in KERNEL_ENV:
        monkeypatch.delenv(k, raising=False)
    cpu = torch.device("cpu")
    plain = fingerprint(cpu)
    assert fingerprint(cpu) == plain
    seen = {plain}
    for k, v in [("HPIPE_CPU_ISA", "avx2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2"),
                 ("HPIPE_DECODE_DOT", "int8")]:
        with monkeypatch.context() as m:
            m.setenv(k, v)
            seen.add(fingerprint(cpu))
    assert len(seen) == 5


def test_other_kernels_change_the_fingerprint(monkeypatch):
    """A grid cached with one build of the CPU kernels is not reused with another (a grid of an
    earlier session's kernels predicted a plan 1.6x slower than a fresh one did)."""
    from hpipe.model.kernels import library

    cpu = torch.device("cpu")
    monkeypatch.setattr(library, "switched_off", lambda: False)
    monkeypatch.setattr(library, "name", lambda: "hpipe_decode_aaaaaaaaaaaa")
    first = fingerprint(cpu)
    monkeypatch.setattr(library, "name", lambda: "hpipe_decode_bbbbbbbbbbbb")
    second = fingerprint(cpu)
    monkeypatch.setattr(library, "switched_off", lambda: True)  # HPIPE_CPU_KERNEL=off: says so
    assert len({first, second, fingerprint(cpu)}) == 3
