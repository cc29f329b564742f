"""Every command, fed the bad input a new user gives it: one line saying what is wrong, a non-zero
exit, and no traceback."""

import pytest

from hpipe.app.cli import main


def one_line_error(capsys, argv) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argument errors
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, None), (argv, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("hpipe"), (argv, err)
    return lines[0]


@pytest.fixture
def files(tmp_path):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: x\ndaemons:\n  - {name: a, address: '127.0.0.1:1'\n   threads: [\n")
    two = tmp_path / "two.yaml"
    two.write_text("daemons:\n  - {name: a, address: '127.0.0.1:1', threads: two}\n")
    return {"binary": str(binary), "bad_yaml": str(bad_yaml), "two": str(two), "dir": str(tmp_path),
            "missing_dir_out": str(tmp_path / "no" / "such" / "plan.json")}


@pytest.mark.parametrize("argv,says", [
    (["generate", "--cluster", "{binary}", "--prompt", "hi"], "not UTF-8"),
    (["generate", "--cluster", "{two}", "--prompt", "hi"], "threads 'two' is not valid"),
    (["generate", "--cluster", "{bad_yaml}", "--prompt", "hi"], "not valid YAML at line"),
    (["generate", "--prompt-file", "{binary}"], "is not UTF-8 text"),
    (["generate", "--prompt-file", "{dir}"], "cannot read prompt file"),
    (["generate", "--prompt", "hi", "--threads", "-1"], "expected a positive integer"),
    (["generate", "--prompt", "hi", "--device", "tpu"], "is not cpu or cuda:N"),
    (["generate", "--prompt", "hi", "--device", "cuda:0"], "CUDA"),
    (["plan", "--profile", "{binary}", "--seq-len", "64"], "is not UTF-8 text"),
    (["plan", "--profile", "{dir}", "--seq-len", "64"], "cannot read profile"),
    (["plan", "--profile", "x.json", "--seq-len", "64", "--granularity", "0"], "expected a positive integer"),
    (["run", "--plan", "{binary}", "--instruction", "x", "doc.txt"], "is not UTF-8 text"),
    (["bench", "--plan", "{binary}"], "is not UTF-8 text"),
    (["bench", "--plan", "x.json", "--workload", "no-such"], "bundled workloads: mixed"),
    (["bench", "--plan", "x.json", "--workload", "{binary}"], "cannot read workload"),
    (["bench", "--plan", "x.json", "--workload", "{two}"], "expected {\"arrival_s\""),
    (["bench", "--plan", "x.json", "--workload", "generate", "--rate", "0"], "arrival rate must be > 0"),
    (["serve", "--plan", "{binary}"], "is not UTF-8 text"),
    (["profile", "--cluster", "{bad_yaml}"], "not valid YAML"),
    (["cluster", "status", "{two}"], "threads 'two' is not valid"),
    (["cluster", "up", "no-such-cluster"], "no such file (bundled clusters: "),
    (["daemon", "--port", "99999"], "port 99999 is outside 0-65535"),
    (["daemon", "--port", "1", "--threads", "0"], "threads must be >= 1"),
    (["daemon", "--port", "1", "--device", "tpu"], "is not cpu or cuda:N"),
    (["daemon", "--port", "1", "--tls-cert", "nope.pem"], "TLS certificate and key go together"),
    (["daemon", "--port", "0", "--tls-cert", "nope.pem", "--tls-key", "nope.key"], "cannot read the TLS key"),
    (["nonsense"], "invalid choice"),
])
def test_bad_input_is_one_line(capsys, files, argv, says):
    import torch

    if "cuda:0" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_line_error(capsys, [a.format(**files) for a in argv])
    assert says in line, line


def test_plan_output_into_a_missing_folder(capsys, files, tmp_path):
    import random

    from tests.planner.synthetic import make_profile

    profile = tmp_path / "p.json"
    profile.write_text(make_profile(random.Random(0), n=2).to_json())
    line = one_line_error(capsys, ["plan", "--profile", str(profile), "--seq-len", "64", "-o",
                                   files["missing_dir_out"]])
    assert "cannot write" in line and "does not exist" in line


def test_run_output_naming_a_folder(capsys, files, tmp_path):
    import random

    from planner.costs import Workload
    from planner.strategies import plan
    from tests.planner.synthetic import make_profile

    path = tmp_path / "plan.json"
    path.write_text(plan(make_profile(random.Random(0), n=2), Workload(64)).to_json())
    line = one_line_error(capsys, ["run", "--plan", str(path), "--instruction", "x", "-o", files["dir"], "d.txt"])
    assert "is a folder" in line
