"""A kernel that cannot be built fails loudly: set-up stops with the compiler's message where a
compiler exists, a machine without one is told in one line what runs slower, and under CI a
missing kernel fails the tests that need it instead of skipping them (CI stayed green with no
kernel before: the quantized and kernel test modules skipped at module level)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def broken_compiler(tmp_path):
    """A C++ compiler that answers ``--version`` as g++ does and fails every compile with an error
    of its own; and an empty kernel cache, so the kernels must be built with it."""
    cxx = tmp_path / "bin" / "cxx"
    cxx.parent.mkdir()
    cxx.write_text('#!/bin/sh\ncase "$*" in *--version*|*-dumpversion*) exec g++ "$@";; esac\n'
                   'echo "cxx: error: this compiler is broken for the test" >&2\nexit 1\n')
    cxx.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    return dict(env, CXX=str(cxx), HPIPE_CACHE_DIR=str(tmp_path / "cache"))


def _kernels_build(env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpipe.model.kernels"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_failing_build_stops_setup_with_the_compilers_message(broken_compiler):
    if not any(Path(p, "g++").exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no g++ here to answer for the broken compiler's --version")
    done = _kernels_build(broken_compiler)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "failed to build" in done.stderr and "this compiler is broken for the test" in done.stderr


def test_without_a_compiler_setup_goes_on_and_says_what_runs_slower(broken_compiler):
    done = _kernels_build(dict(broken_compiler, CXX=str(Path(broken_compiler["CXX"]).parent / "no-such-c++")))
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "no C++ compiler" in line]
    assert len(said) == 1 and "slower" in said[0] and "--dequantize" in said[0]


@pytest.mark.parametrize("ci", [False, True])
def test_under_ci_a_missing_kernel_fails_the_tests_that_need_it(broken_compiler, ci):
    env = dict(broken_compiler, CI="true") if ci else broken_compiler
    test = "tests/model/test_quantize.py::test_widths_the_type_cannot_hold_fall_back"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    last = done.stdout.strip().splitlines()[-1]
    if ci:
        assert done.returncode != 0 and "1 error" in last and "skipped" not in last, done.stdout[-3000:]
        assert "CI runs the CPU kernels' tests" in done.stdout
    else:
        assert done.returncode == 0 and "1 skipped" in last, done.stdout[-3000:]


def test_a_build_killed_half_way_does_not_hang_the_next(broken_compiler):
    """A build killed half-way (Ctrl-C during set-up, a test run cut short) leaves PyTorch's lock
    file in the build folder; the next build waited on it for ever. hpipe holds a lock of its own
    around a build, which the OS frees when its holder dies, and under it clears PyTorch's."""
    from hpipe.model.kernels import library

    if not any(Path(p, "g++").exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no g++ here to answer for the broken compiler's --version")
    stale = Path(broken_compiler["HPIPE_CACHE_DIR"]) / "kernels" / library.name() / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-m", "hpipe.model.kernels"], cwd=ROOT, env=broken_compiler,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited on a dead build's lock file")
    assert done.returncode == 1 and "this compiler is broken for the test" in done.stderr, done.stderr[-2000:]
