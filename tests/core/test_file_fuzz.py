"""A fuzzer for the files a user hands hpipe: cluster (YAML), profile and plan (JSON). Each case is
a valid file with one thing broken (a key gone, a value of another type or out of range, a key
hpipe does not know, a list for a mapping, the text cut short); each is either read (when what it
changed is still valid) or refused with one line naming the file, never a traceback (issue 64).
"""

import copy
import json
import random
from pathlib import Path

import pytest
import yaml

from hpipe.app.inputs import load_plan, load_profile
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from planner.costs import Workload
from planner.strategies import plan
from tests.planner.synthetic import make_profile

CASES = 200
ODD_VALUES = [None, "x", "", -1, 0, 2**70, 1.5, -1e308, float("nan"), True, [], {}, [1, "a"], {"k": 1}, "1e999"]


def _paths(node, at=()):
    yield at
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, at + (i,))


def _mutate(doc, rng: random.Random):
    """``doc`` with one thing broken, and what."""
    doc = copy.deepcopy(doc)
    path = rng.choice([p for p in _paths(doc) if p])
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    how = rng.randrange(4)
    if how == 0:
        del parent[key]
        return doc, f"removed {path}"
    if how == 1:
        parent[key] = rng.choice(ODD_VALUES)
        return doc, f"odd value at {path}"
    if how == 2 and isinstance(parent, dict):
        parent["surplus_" + str(key)] = 1
        # a model's config.json and a file's meta may hold any keys
        free = path[0] in ("model", "meta") or path[:1] == ("strategies",) and len(path) == 2
        return doc, f"{'free' if free else 'unknown'} key beside {path}"
    value = parent[key]
    parent[key] = list(value.values()) if isinstance(value, dict) else {"a": value}
    return doc, f"reshaped {path}"


def _one_line_refusal_or_read(read, path: Path, what: str) -> None:
    try:
        read(path)
    except HpipeError as e:
        msg = str(e)
        assert "\n" not in msg.strip() and str(path) in msg, f"{what}: {msg!r}"
    except Exception as e:  # noqa: BLE001: the point of the test
        pytest.fail(f"{what}: {type(e).__name__}: {e}")


def _fuzz(doc, dump, read, tmp_path, seed: int, must_refuse_unknown: bool = True) -> None:
    rng = random.Random(seed)
    path = tmp_path / "case"
    for _ in range(CASES):
        if rng.random() < 0.1:  # cut short
            text = dump(doc)
            path.write_text(text[:rng.randrange(len(text))])
            _one_line_refusal_or_read(read, path, "cut short")
            continue
        bad, what = _mutate(doc, rng)
        path.write_text(dump(bad))
        if must_refuse_unknown and what.startswith("unknown key"):
            with pytest.raises(HpipeError, match="surplus_"):
                read(path)
        _one_line_refusal_or_read(read, path, what)


@pytest.fixture(scope="module")
def profile_doc():
    return make_profile(random.Random(1), n=3, layers=4).to_dict()


def test_profile_files(profile_doc, tmp_path):
    _fuzz(profile_doc, json.dumps, lambda p: load_profile(str(p)), tmp_path, seed=1)


def test_plan_files(profile_doc, tmp_path):
    from hpipe.core.profile import Profile

    doc = plan(Profile.from_dict(profile_doc), Workload(seq_len=256, batch=2, max_len=512)).to_dict()
    _fuzz(doc, json.dumps, lambda p: load_plan(str(p)), tmp_path, seed=2)


@pytest.mark.parametrize("name", ["local-3", "emulated-hetero", "home-whatif", "paper-hpipe"])
def test_cluster_files(name, tmp_path):
    doc = yaml.safe_load(Path(f"clusters/{name}.yaml").read_text())
    _fuzz(doc, yaml.safe_dump, lambda p: ClusterSpec.load(p).link_specs() if "links" in doc else ClusterSpec.load(p),
          tmp_path, seed=3)
