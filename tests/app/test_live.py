"""What the page's endpoint reports (:mod:`hpipe.app.live`), from made-up Status replies."""

import json
from dataclasses import replace
from types import SimpleNamespace

from hpipe.app.live import Live, plan_view
from hpipe.core.config import ModelConfig
from hpipe.core.plan import Plan, Stage, StrategyPlan
from hpipe.core.units import UnitRange


def _plan(meta=None) -> Plan:
    cfg = ModelConfig("LlamaForCausalLM", "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)
    stages = (Stage("a", "h:1", UnitRange(0, 5, 4), compute_s=1.0),
              Stage("b", "h:2", UnitRange(5, 10, 4), compute_s=3.0))
    return Plan("m", cfg, "float32", 1, 64, 64, 16, "hpipe", {"hpipe": StrategyPlan("hpipe", stages, 2, (64,), 1.0)},
                {64: (64,)}, meta=meta or {})


def _reply(clock, busy, used=3):
    return SimpleNamespace(loaded=True, clock_s=clock, busy_s=busy, device="cpu", device_name="A CPU", threads=2,
                           weight_bytes=10, kv_bytes=20, resident_bytes=30, free_bytes=40, memory_budget=50,
                           pools=[SimpleNamespace(stage=0, used_blocks=used, blocks=8, cached_blocks=1)])


def test_the_plan_in_layers_with_predicted_shares_links_and_seesaw():
    links = [{"src": "a", "dst": "b", "bandwidth_Bps": 1e8, "latency_s": 1e-3}]
    view = plan_view(_plan({"links": links, "seesaw": {"prefill": [{"daemon": "a", "units": [0, 10]}],
                                                       "decode": [], "choice": "seesaw", "gain": 1.2}}))
    assert [s["layers"] for s in view["stages"]] == ["embed … mlp_1", "attn_2 … head"]
    assert [s["predicted_share"] for s in view["stages"]] == [0.25, 0.75]
    assert view["links"] == links and set(view["seesaw"]) == {"prefill", "decode", "choice"}
    assert plan_view(_plan())["seesaw"] is None


def test_busy_is_the_workers_seconds_over_the_daemons_clock_and_health_changes_are_events():
    live = Live(_plan(), every_s=1.0)
    live.daemon("a", "h:1", _reply(100.0, 5.0))
    live.daemon("b", "h:2", why="not responding")
    live.round(state="ok", health="daemon b is not responding", waiting=1, running=2, tokens=0, totals={})
    first = json.loads(live.body())
    assert [d["busy"] for d in first["daemons"]] == [None, None]  # one reading tells nothing yet
    assert first["daemons"][1]["up"] is False and first["health"] == "daemon b is not responding"
    live.daemon("a", "h:1", _reply(102.0, 6.5))
    live.daemon("b", "h:2", _reply(50.0, 1.0))
    live.round(state="ok", health="", waiting=0, running=4, tokens=30, totals={}, phase="prefill")
    body = json.loads(live.body())
    assert [d["busy"] for d in body["daemons"]] == [0.75, None]
    assert body["series"][-1]["busy"] == {"a": 0.75, "b": None} and body["series"][-1]["kv_used"] == 6
    assert body["series"][-1]["tokens_per_s"] > 0 and len(body["series"]) == 2
    assert [e["kind"] for e in body["events"]] == ["health", "phase", "recovered"]
    assert body["phase"] == "prefill"


def test_the_series_keeps_the_last_minutes_only():
    live = Live(replace(_plan()), every_s=60.0)
    for _ in range(30):
        live.round(state="ok", health="", waiting=0, running=0, tokens=0, totals={})
    assert len(json.loads(live.body())["series"]) == 10  # HISTORY_S / every_s
