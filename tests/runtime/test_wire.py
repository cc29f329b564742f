"""What crosses the wire: dtypes and stages as messages, and never a pickle."""

import re
from pathlib import Path

import pytest
import torch

from hpipe.core.errors import InputError
from hpipe.core.plan import Stage
from hpipe.core.units import UnitRange
from runtime.wire.messages import dtype_from_wire, dtype_to_wire, stage_from_wire, stage_to_wire

ROOT = Path(__file__).resolve().parents[2]
#: what would deserialize code from bytes: pickle and its kin, torch.load (pickle underneath)
UNSAFE = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|cloudpickle|dill|marshal|shelve|joblib)\b|torch\.load\(",
                    re.M)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_dtype_round_trip(dtype):
    assert dtype_from_wire(dtype_to_wire(dtype)) == dtype


def test_unknown_dtypes_are_refused():
    with pytest.raises(InputError, match="cannot travel"):
        dtype_to_wire(torch.complex64)
    with pytest.raises(InputError, match="unknown wire dtype"):
        dtype_from_wire(99)


def test_stage_round_trip():
    s = Stage("b", "127.0.0.1:50052", UnitRange(3, 17, 30))
    assert stage_from_wire(stage_to_wire(s, data_port=7000)) == s
    assert stage_to_wire(s, data_port=7000).data_port == 7000


def test_no_pickle_anywhere_on_the_wire():
    """Read from the checkout whatever the working folder: every module of hpipe's packages."""
    files = [p for pkg in ("runtime", "hpipe", "profiler", "planner") for p in (ROOT / pkg).rglob("*.py")
             if "proto_gen" not in p.parts]
    assert len(files) > 80, f"read only {len(files)} modules under {ROOT}"
    found = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in files for m in UNSAFE.finditer(p.read_text())]
    assert not found, found
    # the pattern itself finds what it must
    assert UNSAFE.search("import pickle\n") and UNSAFE.search("x = torch.load(f)") and UNSAFE.search("from dill import x")
