"""What-if shapes that name a quantization: the profile and the planner count the bytes as stored."""

import json

import pytest

from hpipe.app.cli import main
from hpipe.core.errors import ModelSourceError, StatusError
from hpipe.core.profile import Profile
from hpipe.core.shapes import QUANT_BITS, quantization_bits, random_config


def test_a_quantization_names_bits_and_keeps_the_shape():
    assert quantization_bits("random:llama3-8b@q4_k_m") == QUANT_BITS["q4_k_m"]
    assert quantization_bits("random:llama3-8b") == 0.0
    assert random_config("random:llama3-8b@Q8_0") == random_config("random:llama3-8b")
    with pytest.raises(ModelSourceError, match="unknown quantization 'q3_x'"):
        random_config("random:llama3-8b@q3_x")


def _whatif(tmp_path, model: str) -> tuple[int, Profile]:
    out = tmp_path / f"{model.replace(':', '_').replace('@', '_')}.json"
    assert main(["profile", "--simulate", "--cluster", "clusters/home-whatif.yaml", "--model", model,
                 "--dtype", "float16", "--max-len", "2048", "-o", str(out)]) == 0
    return out, Profile.from_json(out.read_text())


def test_home_cluster_holds_llama3_70b_at_q4_k_m_not_at_float16(tmp_path, capsys):
    """An 8 GB gaming GPU, a 16 GB P100 and a 32 GB CPU host: a 70B model fits at Q4_K_M (every
    stage within its device), and at float16 the planner says it does not fit."""
    q4, prof = _whatif(tmp_path, "random:llama3-70b@q4_k_m")
    fp16, dense = _whatif(tmp_path, "random:llama3-70b")
    assert prof.weight_bits == QUANT_BITS["q4_k_m"] and dense.weight_bits == 0.0
    ratio = prof.unit_weight_bytes("mlp") / dense.unit_weight_bytes("mlp")
    assert ratio == pytest.approx(QUANT_BITS["q4_k_m"] / 16, rel=1e-3)
    assert Profile.from_json(prof.to_json()).weight_bits == prof.weight_bits
    capsys.readouterr()
    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(q4), "--seq-len", "2048", "-o", str(plan), "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["daemons"] == ["rtx3070", "p100", "cpu"]
    assert main(["plan", "--profile", str(fp16), "--seq-len", "2048", "-o", str(tmp_path / "no.json")]) != 0
    assert "does not fit" in capsys.readouterr().err


def test_daemons_refuse_a_quantized_what_if_shape():
    from runtime.daemon.deployment import model_config

    with pytest.raises(StatusError, match="what-if profiles"):
        model_config("random:tiny@q4_0")
