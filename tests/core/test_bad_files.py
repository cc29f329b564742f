"""Forty bad cluster, profile and plan files, each refused in one line that names the file and
the key at fault (``FILE: path.to.key: what is wrong``), from hpipe/core/schemas.py and the checks
that span keys."""

import copy
import json
import random

import pytest
import yaml

from hpipe.app.inputs import load_plan, load_profile
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from planner.costs import Workload
from planner.strategies import plan
from tests.planner.synthetic import make_profile

CLUSTER = {"name": "c", "daemons": [{"name": "a", "address": "127.0.0.1:50151", "threads": 1},
                                    {"name": "b", "address": "127.0.0.1:50152"}],
           "links": {"same_host": {"gbit_s": 10, "latency_ms": 0.1}}}


def _set(doc, path: str, value):
    """``doc`` with the key at ``path`` (dots; list indices as numbers) set, or removed (value ...)."""
    doc = copy.deepcopy(doc)
    *head, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = doc
    for k in head:
        node = node[k]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return doc


CLUSTER_CASES = [
    ("daemons", [], r"daemons: List should have at least 1 item"),
    ("daemons", {"a": 1}, r"daemons: Input should be a valid list"),
    ("daemons.0.address", ..., r"daemons\.0\.address: missing"),
    ("daemons.0.address", 5, r"daemons\.0\.address: Input should be a valid string"),
    ("daemons.0.threads", 0, r"daemons\.0: daemon a: threads must be >= 1"),
    ("daemons.0.turbo", True, r"daemons\.0: unknown settings \['turbo'\]"),
    ("daemons.0.emulate", {"rate": "fast"}, r"daemons\.0\.emulate\.rate: should be a rate"),
    ("daemons.0.emulate", {"cpu_quota": -1}, r"daemons\.0\.emulate\.cpu_quota: Input should be greater than 0"),
    ("daemons.0.ssh", {"to": "me@h", "password": "x"}, r"daemons\.0\.ssh\.password: not a key"),
    ("daemons.0.spec", {"peak_tflops": 1, "mem_bw_gbs": 1}, r"daemons\.0\.spec\.memory: missing"),
    ("links", [1], r"links: Input should be a valid dictionary"),
    ("links.same_host.gbit_s", "fast", r"links\.same_host\.gbit_s: Input should be a valid number"),
    ("links.pairs", [{"src": "a", "gbit_s": 1}], r"links\.pairs\.0\.dst: missing"),
    ("nodes", [], r"nodes: not a key hpipe knows here"),
]


@pytest.mark.parametrize("path,value,match", CLUSTER_CASES, ids=[c[0] for c in CLUSTER_CASES])
def test_bad_cluster_files(tmp_path, path, value, match):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(_set(CLUSTER, path, value)))
    _refused(lambda: ClusterSpec.load(f).link_specs(), f, match)


@pytest.fixture(scope="module")
def profile_doc():
    return make_profile(random.Random(1), n=3, layers=4).to_dict()


PROFILE_CASES = [
    ("version", "2", r"version: Input should be a valid integer"),
    ("version", 1, r"profile format version 1 is not supported"),
    ("dtype", "float8", r"dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    ("daemons", [], r"daemons: List should have at least 1 item"),
    ("daemons.0.memory_bytes", 0, r"daemons\.0\.memory_bytes: Input should be greater than or equal to 1"),
    ("daemons.0.memory_bytes", "1GiB", r"daemons\.0\.memory_bytes: Input should be a valid integer"),
    ("daemons.0.compute.attn.tokens", [], r"daemons\.0\.compute\.attn\.tokens: List should have at least 1 item"),
    ("daemons.0.compute.attn.seconds", [[[-1.0]]], r"daemons\.0\.compute\.attn\.seconds\.0\.0\.0: Input should be "
                                                   r"greater than or equal to 0"),
    ("daemons.0.compute.mlp", ..., r"daemon d0: no compute grid for \['mlp'\]"),
    ("links.0.bandwidth_Bps", 0, r"links\.0\.bandwidth_Bps: Input should be greater than 0"),
    ("links.0.src", ..., r"links\.0\.src: missing"),
    ("links.0.speed", 1, r"links\.0\.speed: not a key hpipe knows here"),
    ("model.hidden_size", 0, r"config\.json: hidden_size must be >= 1"),
]


@pytest.mark.parametrize("path,value,match", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_bad_profile_files(profile_doc, tmp_path, path, value, match):
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(_set(profile_doc, path, value)))
    _refused(lambda: load_profile(str(f)), f, match)


@pytest.fixture(scope="module")
def plan_doc(profile_doc):
    from hpipe.core.profile import Profile

    return plan(Profile.from_dict(profile_doc), Workload(seq_len=256, batch=2, max_len=512)).to_dict()


PLAN_CASES = [
    ("batch", 0, r"batch: Input should be greater than or equal to 1"),
    ("seq_len", 2.5, r"seq_len: Input should be a valid integer"),
    ("strategy", "fastest", r"plan has no strategy 'fastest'"),
    ("strategies", [], r"strategies: Input should be a valid dictionary"),
    ("strategies.hpipe.stages", [], r"strategies\.hpipe\.stages: List should have at least 1 item"),
    ("strategies.hpipe.stages.0.unit_start", -1, r"strategies\.hpipe\.stages\.0\.unit_start: Input should be greater"),
    ("strategies.hpipe.stages.0.daemon", ..., r"strategies\.hpipe\.stages\.0\.daemon: missing"),
    ("strategies.hpipe.micro_batches", 0, r"strategies\.hpipe\.micro_batches: Input should be greater than"),
    ("strategies.hpipe.slices", [0], r"strategies\.hpipe\.slices\.0: Input should be greater than or equal to 1"),
    ("strategies.hpipe.predicted_s", "soon", r"strategies\.hpipe\.predicted_s: Input should be a valid number"),
    ("slicing", {"abc": [1]}, r"slicing\.abc\.\[key\]: should be a length in tokens"),
    ("slicing_for", "gpipe2", r"slicing table is for strategy 'gpipe2'"),
    ("schedul", {}, r"schedul: not a key hpipe knows here"),
]


@pytest.mark.parametrize("path,value,match", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_files(plan_doc, tmp_path, path, value, match):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(_set(plan_doc, path, value)))
    _refused(lambda: load_plan(str(f)), f, match)


def test_forty_cases():
    assert len(CLUSTER_CASES) + len(PROFILE_CASES) + len(PLAN_CASES) == 40


def _refused(read, path, match: str) -> None:
    with pytest.raises(HpipeError) as e:
        read()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    assert __import__("re").search(match, msg), msg
