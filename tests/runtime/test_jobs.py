"""hpipe run and hpipe bench on a live cluster, with a plan from a live profile."""

import json

import pytest

from hpipe.app.bench import energy_reader
from hpipe.app.cli import main
from hpipe.app.jobs import build_prompt
from hpipe.core.errors import ModelSourceError
from hpipe.model.generate.local import LocalModel, generate_ids
from hpipe.model.kernels.precision import set_prefill_gemm

INSTRUCTION = "Summarize in one sentence."


def test_run_matches_single_process_and_resumes(cluster3, smollm2, plan_file, tmp_path, capsys):
    path, plan = plan_file
    docs = []
    for i, text in enumerate(["The cat sat on the mat. " * (5 + 3 * i) for i in range(3)]):
        p = tmp_path / f"doc{i}.md"
        p.write_text(text)
        docs.append(str(p))
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("word " * 400)
    out = tmp_path / "results.jsonl"
    args = ["run", "--plan", str(path), "--cluster", str(cluster3.path), "--chat", "--instruction", INSTRUCTION,
            "--max-new-tokens", "8", "-o", str(out)]
    assert main(args + ["--long", "refuse"] + docs + [str(long_doc)]) == 1  # the long one fails, the others are done
    err = capsys.readouterr().err
    assert "long.txt" in err and "at most 256" in err
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["document"] for r in rows if "error" in r] == [str(long_doc)]  # recorded with its error
    rows = [r for r in rows if "error" not in r]
    assert sorted(r["document"] for r in rows) == sorted(docs)
    tok, model = smollm2.tokenizer(), LocalModel(smollm2)
    for r in rows:
        ids, _ = build_prompt(tok, INSTRUCTION, open(r["document"]).read(), True, 256, "none")
        ref = generate_ids(model.open, tok, ids, context=smollm2.config.max_position_embeddings,
                           eos_ids=smollm2.eos_token_ids(), max_new_tokens=8)
        assert r["token_ids"] == ref.token_ids and r["prompt_tokens"] == len(ids)
        # the documents begin alike: a later one prefills only what the cache lacks, sliced by the plan
        assert r["slices"] == len(plan.slices_for(len(ids) - r["cached_tokens"]))
    # re-running skips what is done; --truncate head fits the long one
    assert main(args + ["--truncate", "head", "--json"] + docs + [str(long_doc)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == 3 and summary["documents"] == 1
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["document"] == str(long_doc) and last["truncated_tokens"] > 0 and last["prompt_tokens"] <= 256


def test_run_asks_several_questions_about_each_document(cluster3, smollm2, plan_file, tmp_path, capsys):
    """Two documents, three questions each (a JSONL file): every answer is single-process
    generation's for its (document, question) prompt, with the cache and without; with it, each
    document is prefilled once and its other questions skip its blocks. A re-run skips all six."""
    path, plan = plan_file
    docs = []
    for i, text in enumerate(["A ledger of the harbour, kept by the clerk. " * 6, "The orchard has pears. " * 9]):
        p = tmp_path / f"doc{i}.md"
        p.write_text(text)
        docs.append(str(p))
    questions = ["Who kept it?", "What is it about?", "Is it long?"]
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text('{"question": "Who kept it?"}\n"What is it about?"\n\n{"question": "Is it long?"}\n')
    tok, model = smollm2.tokenizer(), LocalModel(smollm2)
    runs = {}
    for cache in ("on", "off"):
        out = tmp_path / f"results-{cache}.jsonl"
        args = ["run", "--plan", str(path), "--cluster", str(cluster3.path), "--chat", "--questions", str(qfile),
                "--max-new-tokens", "6", "--json", "-o", str(out)] + (["--no-prefix-cache"] if cache == "off" else [])
        assert main(args + docs) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["documents"] == 2 and summary["answers"] == 6 and not summary["failed"], summary
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted((r["document"], r["question"]) for r in rows) == sorted((d, q) for d in docs for q in questions)
        runs[cache] = {(r["document"], r["question"]): r for r in rows}
        if cache == "on":
            # two later questions of each document hit (and the first question of one may hit the chat
            # template's opening, which every prompt shares)
            assert summary["prefix_cache"]["hits"] >= 4, summary["prefix_cache"]
            for d in docs:
                cached = sorted(runs[cache][d, q]["cached_tokens"] for q in questions)
                assert cached[0] <= 32 and cached[1] >= cached[0] + 48, cached  # the document's blocks
            assert main(args + docs) == 0  # everything is answered: nothing runs
            assert json.loads(capsys.readouterr().out)["skipped"] == 6
        else:
            assert summary["prefix_cache"] is None and all(r["cached_tokens"] == 0 for r in rows)
    for (doc, question), r in runs["on"].items():
        ids, _ = build_prompt(tok, question, open(doc).read(), True, 256, "none")
        ref = generate_ids(model.open, tok, ids, context=smollm2.config.max_position_embeddings,
                           eos_ids=smollm2.eos_token_ids(), max_new_tokens=6)
        assert r["token_ids"] == ref.token_ids == runs["off"][doc, question]["token_ids"]


@pytest.mark.parametrize("order", ["blocks", "interleaved"])
def test_bench_reports_every_strategy(cluster3, plan_file, capsys, order, tmp_path):
    path, plan = plan_file
    repeat = 1 if order == "blocks" else 2
    # blocks: also re-time the profile's reference stage, before and after, to re-predict at today's
    # speed, and chart the pipeline as planned and as it ran
    chart = tmp_path / "bench.png"
    extra = (["--interleave"] if order == "interleaved"
             else ["--profile", str(path.parent / "profile.json"), "--chart", str(chart)])
    assert main(["bench", "--plan", str(path), "--cluster", str(cluster3.path), "--strategies", "hpipe,base",
                 "--repeat", str(repeat), "--json"] + extra) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out["strategies"]) == {"hpipe", "base"} and out["ideal_s"] > 0 and out["order"] == order
    if order == "blocks":
        cal = out["calibration"]
        devices = {s.daemon for n in ("hpipe", "base") for s in plan.strategies[n].stages}
        assert set(cal["factors"]) == devices
        # same machine, minutes apart: a factor far from 1 would be a broken measurement, not drift
        assert all(0.3 < f < 3 for f in cal["factors"].values()), cal
        for r in out["strategies"].values():
            assert r["predicted_now_s"] > 0
        # the bound re-computed at today's speeds moves with them: all slower -> a larger bound
        f = cal["factors"]
        assert min(f.values()) * 0.999 <= out["ideal_now_s"] / out["ideal_s"] <= max(f.values()) * 1.001
        assert "at the speeds measured now" in captured.err and "ideal now/meas" in captured.err
        assert "speed vs profile" in captured.err and "pred now s" in captured.err
        assert "hpipe per stage" in captured.err and chart.stat().st_size > 10_000
        assert "CPU steal per run" in captured.err and "host CPU per run outside the device workers" in captured.err
        for r in out["strategies"].values():
            assert all(len(st["predicted_timeline"]) == len(st["timeline"]) for st in r["stages"])
    else:
        assert "calibration" not in out
    for name, r in out["strategies"].items():
        assert len(r["runs_s"]) == repeat and r["latency_s"] > 0 and r["tokens_per_s"] > 0 and r["predicted_s"] > 0
        assert all(v > 0 for v in r["peak_memory_bytes"].values())
        # per-stage statistics come from the median run
        stages = plan.strategies[name].stages
        assert r["stages_run_s"] == sorted(r["runs_s"])[(repeat - 1) // 2] and len(r["stages"]) == len(stages)
        assert r["daemons"] == list(dict.fromkeys(s.daemon for s in stages))  # once each, if interleaved
        assert set(r["predicted_memory_bytes"]) == set(r["daemons"])
        # each daemon's CPU steal during each run: known on Linux, never negative
        assert len(r["runs_steal_s"]) == repeat
        assert all(set(run) == set(r["daemons"]) and all(v is not None and v >= 0 for v in run.values())
                   for run in r["runs_steal_s"])
        # what moving the slices cost each daemon's host outside its worker: sliced runs send
        # activations between stages, so every daemon but the last spends some CPU on it
        assert set(r["host_cpu_s"]) == set(r["daemons"]) and all(v >= 0 for v in r["host_cpu_s"].values())
        assert r["host_cpu_s"][r["daemons"][0]] > 0
        _check_timeline(r, out["seq_len"])
    # energy: what this machine can read, and a reading per strategy exactly where it can
    _, source = energy_reader()
    assert out["energy_source"] == source
    assert all((r["energy_j"] is not None and r["energy_j"] >= 0) == (source != "unavailable")
               for r in out["strategies"].values())


def test_energy_reader_sums_rapl_packages(tmp_path):
    for name, uj in (("intel-rapl:0", 5_000_000), ("intel-rapl:1", 2_000_000), ("intel-rapl:0:0", 9_000_000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "energy_uj").write_text(str(uj))
    read, source = energy_reader(str(tmp_path))
    assert source == "rapl" and read() == pytest.approx(7.0)  # packages only: the sub-zone is inside package 0
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("3500000")
    assert read() == pytest.approx(8.5)


#: clocks of daemons on this machine agree; the offset estimate is good to a round trip's half
CLOCK_SLACK_S = 0.005


def _check_timeline(row: dict, seq_len: int) -> None:
    """Every slice of every micro-batch ran once per stage, one at a time, after it arrived and after
    the stage before finished it, and within the run."""
    slices = [x[1:3] for x in row["stages"][0]["timeline"] if x[0] == 0]
    assert len(slices) == row["slices"]
    assert [a for a, _ in slices] == [sum(n for _, n in slices[:k]) for k in range(len(slices))]
    assert sum(n for _, n in slices) == seq_len
    ends_before = None
    for st in row["stages"]:
        tl = st["timeline"]
        assert len(tl) == row["slices"] * row["micro_batches"]
        for (u, a, n, received, begin, end), nxt in zip(tl, tl[1:] + [None]):
            assert -CLOCK_SLACK_S <= received <= begin + CLOCK_SLACK_S and begin < end
            assert end <= row["stages_run_s"] + CLOCK_SLACK_S
            if nxt is not None:
                assert end <= nxt[4] + 1e-6  # one worker: no overlap
            if ends_before is not None:
                assert ends_before[(u, a)] <= begin + CLOCK_SLACK_S
        assert abs(sum(x[5] - x[4] for x in tl) - st["compute_s"]) < 0.01 + 0.01 * st["compute_s"]
        ends_before = {(u, a): end for u, a, _, _, _, end in tl}
    # a daemon holding several stages (interleaved) computes one slice at a time over all of them
    for device in {st["daemon"] for st in row["stages"]}:
        spans = sorted(x[4:6] for st in row["stages"] if st["daemon"] == device for x in st["timeline"])
        assert all(e <= b2 + 1e-6 for (_, e), (b2, _) in zip(spans, spans[1:]))


def test_bench_replays_a_workload_under_each_policy(cluster3, plan_file, capsys, tmp_path):
    path, plan = plan_file
    work = tmp_path / "w.jsonl"
    work.write_text("".join(f'{{"arrival_s": {0.05 * i}, "prompt_tokens": {20 + 29 * i}, "output_tokens": {3 + i}}}\n'
                            for i in range(6)))
    chart = tmp_path / "occupancy.png"
    assert main(["bench", "--plan", str(path), "--cluster", str(cluster3.path), "--workload", str(work),
                 "--policies", "gllm,sarathi,fcfs", "--repeat", "1", "--json", "--chart", str(chart)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out["policies"]) == {"gllm", "sarathi", "fcfs"} and out["requests"] == 6
    for name, p in out["policies"].items():
        assert p["same_outputs"] == [6] and p["failed"] == 0, name  # greedy: the same tokens under every policy
        assert p["total_tokens_per_s"] > p["output_tokens_per_s"] > 0 and p["ttft_p50_s"] <= p["ttft_p99_s"]
        assert len(p["stage_busy"]) == len(plan.chosen.stages) and all(0 < b <= 1 for b in p["stage_busy"])
        run = out["runs"][name][0]
        assert sum(len(s["spans"]) for s in run["stages"]) > 0
    # several requests share micro-batches under gllm and sarathi, never under fcfs
    mbs = {n: out["runs"][n][0]["micro_batches"] for n in out["policies"]}
    assert mbs["gllm"] < mbs["fcfs"] and mbs["sarathi"] < mbs["fcfs"]
    assert "busy fraction per stage" in captured.err and chart.stat().st_size > 10_000


def test_ctrl_c_then_run_again_loses_and_repeats_nothing(cluster3, plan_file, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    path, plan = plan_file
    docs = []
    for i in range(6):
        p = tmp_path / f"doc{i}.md"
        p.write_text(f"Report {i}. " + "The cat sat on the mat. " * (4 + i))
        docs.append(str(p))
    out = tmp_path / "results.jsonl"
    # --ignore-eos and 48 tokens a document, one at a time: after the first answer the job has
    # minutes of work left, so the interrupt always lands on work still running
    args = ["run", "--plan", str(path), "--cluster", str(cluster3.path), "--instruction", INSTRUCTION,
            "--max-new-tokens", "48", "--ignore-eos", "--parallel", "1", "-o", str(out)]
    # started as a script's background job is (SIGINT inherited ignored): Python then installs no
    # KeyboardInterrupt handler unless hpipe does, and the interrupt used to be lost
    # (ignored by a shell's trap, not a preexec_fn: that makes Popen fork this big test process, and
    # a fresh-clone CI run once failed that fork with ENOMEM; a shell is spawned without copying it)
    job = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "-m", "hpipe"] + args + docs,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 1):
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read() if job.poll() else "slow"
        time.sleep(0.05)
    assert job.poll() is None
    job.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    code = job.wait(timeout=30)
    stopped_s = time.monotonic() - t0
    err = job.stderr.read()
    assert code == 130 and "interrupted" in err and stopped_s < 10, (code, stopped_s, err)
    first = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    assert 1 <= len(first) < 6
    assert main(args + ["--json"] + docs) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["document"] for r in rows) == sorted(docs)  # none lost, none twice
    assert rows[:len(first)] == first
    # a changed instruction is a different answer: nothing is skipped
    assert main(args[:6] + ["Say one word."] + args[7:] + ["--json", "--max-new-tokens", "2"] + docs) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12


def _bfloat16_prefill() -> bool:
    """Whether this CPU multiplies quantized prefill rows in bfloat16 when asked."""
    try:
        set_prefill_gemm(set_prefill_gemm("bfloat16"))
    except ModelSourceError:
        return False
    return True


def test_bench_runs_a_seesaw_plan_beside_its_two_layouts(cluster3, plan_file, capsys, tmp_path, monkeypatch):
    """hpipe plan --objective seesaw, then hpipe bench --workload with each Seesaw layout alone
    (gllm) and seesaw switching between them: the same greedy outputs, and seesaw switched.
    The daemons' prefill in bfloat16 where the CPU has it: a switch that recomputes KV (replays,
    or a request started again) computes the decoded positions as decode rows, in float32
    (``Entry.prefill_end``), so the tokens stay those of a single layout; sent KV is the same bits."""
    # the coordinator's Load asks the daemons for it
    monkeypatch.setenv("HPIPE_PREFILL_GEMM", "bfloat16" if _bfloat16_prefill() else "float32")
    path, _ = plan_file
    seesaw_plan = tmp_path / "seesaw.json"
    assert main(["plan", "--profile", str(path.parent / "profile.json"), "--seq-len", "96", "--max-len", "256",
                 "--output-len", "24", "--objective", "seesaw", "-o", str(seesaw_plan)]) == 0
    data = json.loads(seesaw_plan.read_text())
    layouts = data["meta"]["seesaw"]
    # whatever the profile chose, make the decode layout another one: the daemons in turn, other cuts
    names = [s["daemon"] for s in layouts["prefill"]] + [d.name for d in cluster3.spec.daemons]
    names = list(dict.fromkeys(names))[:3]
    end = layouts["prefill"][-1]["units"][1]
    layouts["decode"] = [{"daemon": names[1], "units": [0, 9]}, {"daemon": names[2], "units": [9, 40]},
                         {"daemon": names[0], "units": [40, end]}]
    seesaw_plan.write_text(json.dumps(data))
    work = tmp_path / "w.jsonl"
    work.write_text("".join(f'{{"arrival_s": 0, "prompt_tokens": {40 + 13 * i}, "output_tokens": {6 + i}}}\n'
                            for i in range(8)))
    policies = ["gllm@prefill", "gllm@decode", "seesaw", "seesaw-send"]
    assert main(["bench", "--plan", str(seesaw_plan), "--cluster", str(cluster3.path), "--workload", str(work),
                 "--policies", ",".join(policies), "--repeat", "1", "--json", "--kv-pool-mb", "4"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    for name in policies:
        p = out["policies"][name]
        assert p["same_outputs"] == [8] and p["failed"] == 0, name
    seesaw = out["policies"]["seesaw"]
    assert seesaw["switches"] >= 1
    assert "layout switches a run" in captured.err
    # the KV of every moved stage sent (test_seesaw_runtime checks that nothing is rebuilt where the
    # new owners' pools hold every request; these 4 MB pools, cut finer on a daemon that holds more
    # stages, may not, and a request they cannot hold starts again)
    sent = out["policies"]["seesaw-send"]
    assert sent["switches"] >= 1 and sent["sent_bytes"] > 0
    assert "MB sent" in captured.err
    # what each daemon computed in every session of the run, and in each phase (a switch closes one)
    assert set(seesaw["daemon_busy"]) == set(names) and all(v > 0 for v in seesaw["daemon_busy"].values())
    assert set(seesaw["phases"]) == {"prefill", "decode"}
    assert all(x["seconds"] > 0 and any(v > 0 for v in x["busy"].values()) for x in seesaw["phases"].values())
    assert set(out["predicted_busy"]) == set(policies)
    assert "seesaw, decode phase" in captured.err and "planner's prediction" in captured.err
    # hpipe run --policy seesaw: the answers of the plan's single layout
    docs = []
    for i in range(4):
        p = tmp_path / f"doc{i}.md"
        p.write_text(f"Report {i}. " + "The cat sat on the mat. " * (3 + 2 * i))
        docs.append(str(p))
    answers = {}
    for policy in ("gllm", "seesaw"):
        out_file = tmp_path / f"{policy}.jsonl"
        assert main(["run", "--plan", str(seesaw_plan), "--cluster", str(cluster3.path), "--chat", "--instruction",
                     INSTRUCTION, "--max-new-tokens", "6", "--ignore-eos", "--policy", policy, "--json",
                     "-o", str(out_file), *docs]) == 0
        summary = json.loads(capsys.readouterr().out)
        answers[policy] = {r["document"]: r["token_ids"] for r in map(json.loads, out_file.read_text().splitlines())}
    assert answers["seesaw"] == answers["gllm"] and len(answers["gllm"]) == 4
    assert summary["policy"] == "seesaw" and summary["seesaw_switches"]
