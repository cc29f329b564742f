"""A device's fingerprint (what its cached profile grids are keyed by) names everything that sets
its speed: a CPU capped at AVX2 (scripts/avx2.env) computes with other kernels than uncapped, so
the two never share a grid (a capped run planned from an uncapped profile mispredicts)."""

import torch

from profiler.device import ISA_CAPS, fingerprint


def test_an_instruction_set_cap_changes_the_fingerprint(monkeypatch):
    for k in ISA_CAPS:
        monkeypatch.delenv(k, raising=False)
    cpu = torch.device("cpu")
    plain = fingerprint(cpu)
    assert fingerprint(cpu) == plain
    seen = {plain}
    for k, v in [("HPIPE_CPU_ISA", "avx2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2")]:
        with monkeypatch.context() as m:
            m.setenv(k, v)
            seen.add(fingerprint(cpu))
    assert len(seen) == 4
