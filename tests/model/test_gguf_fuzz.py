"""Malformed GGUF files: each a clear one-line error naming the file (a ModelSourceError or
UnsupportedModelError), never a traceback, never a hang, and nothing left in hpipe's cache (issue 64).

A small valid file (``hpipe model make``, 3 layers, SmolLM2's tokenizer) is broken in the places a
parser trusts. 200 structural cases: truncated anywhere, the header's counts made huge, each
tensor's type, dimensions and data offset rewritten, bytes flipped in the tensor table. And each
dimension of the model in the metadata made zero, odd or huge (fewer cases: each goes through
transformers' reading of the tokenizer, seconds apiece). Each file goes through what ``--model
FILE`` does: the import, a stage of the whole model, and a prefill of three tokens."""

import os
import random
import struct
import time
from pathlib import Path

import gguf
import pytest
import torch

from hpipe.core.errors import HpipeError
from hpipe.core.paths import cache_root
from hpipe.core.shapes import SHAPES
from hpipe.model.generate.local import LocalModel
from hpipe.model.weights.random_gguf import Spec, make
from hpipe.model.weights.sources import resolve_model

#: structural cases: each reads the file's 49,152-token vocabulary (about 3 s on two cores), so CI
#: runs 16; ``HPIPE_FUZZ_CASES=200 pytest tests/model/test_gguf_fuzz.py`` runs the full fuzz
CASES = int(os.environ.get("HPIPE_FUZZ_CASES", "16"))
TIMES: list[float] = []  # every case's seconds, for the report at the end
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[bytes, dict]:
    """The file's bytes, and where its parser's trusted numbers lie."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SHAPES, "fuzz", SMALL)
        path = make(Spec.parse("random:fuzz@q4_k_m"), tmp_path_factory.mktemp("fuzz") / "valid.gguf")
    reader = gguf.GGUFReader(path)
    tensors = []
    for t in reader.tensors:  # name length, name, n_dims, dims, type, offset
        at, sizes = t.field.offset, [p.nbytes for p in t.field.parts]
        starts = [at + sum(sizes[:i]) for i in range(len(sizes))]
        tensors.append({"dims": (starts[3], sizes[3]), "type": starts[4], "offset": starts[5]})
    values = {k: f.offset + sum(p.nbytes for p in f.parts[:-1]) for k, f in reader.fields.items()
              if k.startswith("llama.") and f.types and f.types[0] == gguf.GGUFValueType.UINT32}
    return path.read_bytes(), {"tensors": tensors, "values": values, "data": reader.data_offset}


def broken(data: bytes, where: dict, rng: random.Random) -> bytearray:
    b = bytearray(data)
    kind = rng.randrange(7)
    if kind == 0:  # truncated anywhere
        return b[:rng.randrange(0, len(b))]
    if kind == 1:  # truncated inside the tensor data
        return b[:rng.randrange(where["data"], len(b))]
    if kind == 2:  # tensor or KV count made huge
        at = rng.choice((8, 16))
        b[at:at + 8] = struct.pack("<Q", rng.choice((2**31, 2**40, 2**63 - 1, 10**6)))
        return b
    t = rng.choice(where["tensors"])
    if kind == 3:  # a tensor's type: another type, or no type at all
        b[t["type"]:t["type"] + 4] = struct.pack("<I", rng.choice((0, 1, 2, 8, 13, 30, 41, 255, 2**31)))
    elif kind == 4:  # a tensor's data offset: past the end, or unaligned
        b[t["offset"]:t["offset"] + 8] = struct.pack("<Q", rng.choice((2**40, len(data), 1, 33)))
    elif kind == 5:  # a tensor's dimensions: huge, zero, or one off
        at, n = t["dims"]
        i = at + 8 * rng.randrange(n // 8)
        old = struct.unpack("<Q", b[i:i + 8])[0]
        b[i:i + 8] = struct.pack("<Q", rng.choice((0, old + 1, old * 2, 2**40, 2**63)))
    else:  # bytes flipped in the tensor table
        first = min(x["dims"][0] for x in where["tensors"]) - 32
        for _ in range(rng.randrange(1, 16)):
            b[rng.randrange(first, where["data"])] = rng.randrange(256)
    return b


#: the slowest case the full fuzz may have (issue 64's bar); CI's 16 cases only check nothing hangs
#: (30 s: a slow, shared CI machine reads a 49,152-token vocabulary in seconds)
SLOWEST_S = 10.0 if "HPIPE_FUZZ_CASES" in os.environ else 30.0


def run(path: Path) -> str:
    """What ``--model`` does with ``path``: "ran", or the error's class (its message checked)."""
    t0 = time.monotonic()
    try:
        model = LocalModel(resolve_model(str(path)))
        logits = model.open(8).prefill(torch.tensor([[1, 2, 3]]), [3])
        outcome = "ran" if torch.isfinite(logits).all() else "ran, not finite"
    except HpipeError as e:
        assert "\n" not in str(e) and path.name in str(e), str(e)
        outcome = type(e).__name__
    took = time.monotonic() - t0
    assert took < SLOWEST_S, f"{path.name} took {took:.1f} s"  # no case hangs
    TIMES.append(took)
    return outcome


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache of hpipe's own for the cases, sharing the built kernels."""
    kernels = cache_root() / "kernels"
    root = tmp_path / "cache"
    root.mkdir()
    if kernels.exists():
        (root / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("HPIPE_CACHE_DIR", str(root))
    return root


def imports_left(root: Path) -> list[Path]:
    return [p for p in (root / "models").glob("*")] if (root / "models").exists() else []


def test_every_structurally_broken_file_is_one_clear_error(valid, tmp_path, cache):
    data, where = valid
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    for i in range(CASES):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(broken(data, where, rng))
        outcome = run(path)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        path.unlink()
    print(f"{CASES} cases: {outcomes}; slowest {max(TIMES):.1f} s, median {sorted(TIMES)[len(TIMES) // 2]:.1f} s")
    ran = outcomes.get("ran", 0) + outcomes.get("ran, not finite", 0)
    assert len(imports_left(cache)) <= max(ran, 1), (imports_left(cache), outcomes)  # one import per file that ran
    assert outcomes.get("ModelSourceError", 0) >= CASES // 2, outcomes


@pytest.mark.parametrize("key,value", [("block_count", 2**20), ("embedding_length", 0), ("attention.head_count_kv", 3),
                                       ("rope.dimension_count", 3)])
def test_a_dimension_of_the_metadata_that_is_wrong_is_one_clear_error(valid, key, value, tmp_path, cache):
    data, where = valid
    b = bytearray(data)
    at = where["values"][f"llama.{key}"]
    b[at:at + 4] = struct.pack("<I", value)
    path = tmp_path / f"{key}-{value}.gguf"
    path.write_bytes(b)
    assert run(path) in ("ModelSourceError", "UnsupportedModelError", "InputError")
    assert not imports_left(cache)


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_named(tmp_path):
    """A daemon's shipped tensor (one file per tensor in its weights cache) whose declared shape and
    type need other than the bytes it holds: a ModelSourceError naming the tensor when its stage
    loads it, not a reshape's traceback (issue 64)."""
    from hpipe.core.config import ModelConfig
    from hpipe.core.errors import ModelSourceError
    from hpipe.model.weights.gguf import GGUFWeights

    cfg = ModelConfig.from_dict({"model_type": "llama", **SMALL})
    blob = tmp_path / "t"
    blob.write_bytes(bytes(144 * 4))  # four Q4_K blocks: 4 rows of 256, or 1 of 1024
    for shape, ok in (([4, 256], True), ([1, 1024], True), ([8, 256], False), ([3, 256], False), ([4, 100], False),
                      ([4], False), ([0, 256], False)):
        files = {"blk.0.ffn_down.weight": {"type": 12, "shape": shape, "bytes": 144 * 4, "offset": 0,
                                           "file": str(blob)}}
        store = GGUFWeights.of_files("shipped", "llama", files, cfg)
        name = store.names()[0]
        if ok:
            assert store.load([name])[name].rows == shape[0]
        else:
            with pytest.raises(ModelSourceError, match=r"tensor blk\.0\.ffn_down\.weight holds 576 bytes, which are "
                                                       r"not .* Q4_K values"):
                store.load([name])
