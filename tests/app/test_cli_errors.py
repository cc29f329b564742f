"""Bad input: a clear one-line error and a non-zero exit, never a traceback."""

import json

import pytest

from hpipe.app.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unknown_model(capsys):
    code, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert code == 1 and "unknown model 'no-such-model'" in err and "Traceback" not in err


def test_directory_without_config(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 1 and "no config.json" in err


def test_unsupported_architecture_named(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 1 and "GPTNeoXForCausalLM" in err


def test_prompt_longer_than_context(capsys, tiny_chat_model):
    code, _, err = run(capsys, "generate", "--model", str(tiny_chat_model), "--prompt", "word " * 200)
    assert code == 1 and "context is 96 tokens" in err


def test_unit_range_outside_model(capsys, tiny_chat_model):
    code, _, err = run(capsys, "generate", "--model", str(tiny_chat_model), "--prompt", "hi", "--cuts", "3,9")
    assert code == 1 and "strictly increasing within (0, 6)" in err


def test_slices_must_add_up(capsys, tiny_chat_model):
    code, _, err = run(capsys, "generate", "--model", str(tiny_chat_model), "--prompt", "one two three",
                       "--slices", "1,1")
    assert code == 1 and "add up to 2" in err


def test_bad_sampling_and_dtype(capsys, tiny_chat_model):
    code, _, err = run(capsys, "generate", "--model", str(tiny_chat_model), "--prompt", "x", "--top-p", "0")
    assert code == 1 and "top-p" in err
    code, _, err = run(capsys, "generate", "--model", str(tiny_chat_model), "--prompt", "x", "--dtype", "float16")
    assert code == 1 and "float16 is not supported on the CPU" in err


def test_json_output_fields(capsys, tiny_chat_model):
    code, out, _ = run(capsys, "generate", "--model", str(tiny_chat_model), "--chat", "--prompt", "hello",
                       "--max-new-tokens", "5", "--json")
    data = json.loads(out)
    assert code == 0 and {"text", "token_ids", "prompt_tokens"} <= set(data)
    assert 1 <= len(data["token_ids"]) <= 5


def test_colocation_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--cluster", "c.yaml", "--colocation-rounds", "0"])
    assert e.value.code == 2 and "expected a positive integer, got '0'" in capsys.readouterr().err


def test_daemon_prints_a_systemd_unit_that_restarts_it(capsys):
    assert main(["daemon", "--port", "50199", "--name", "box", "--model-dirs", "/srv/models",
                 "--print-systemd-unit"]) == 0
    unit = capsys.readouterr().out
    assert "Restart=on-failure" in unit and "StartLimitBurst=5" in unit
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_line.endswith("-m hpipe daemon --name box --port 50199 --model-dirs /srv/models")


def test_the_process_exits_with_the_commands_code_and_all_its_output(tiny_chat_model):
    """``hpipe`` as a process ends without the interpreter's teardown (which can abort in gRPC's or
    torch's C++ threads): its exit code is the command's, and its output is whole."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "hpipe", "generate", "--model", str(tiny_chat_model), "--prompt",
                         "Hello there", "--max-new-tokens", "3", "--json"], capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert 1 <= len(json.loads(ok.stdout)["token_ids"]) <= 3
    bad = subprocess.run([sys.executable, "-m", "hpipe", "generate", "--model", "no-such-model", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "unknown model" in bad.stderr
