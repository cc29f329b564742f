import pytest

from hpipe.core.cluster import ClusterSpec, parse_size
from hpipe.core.errors import HpipeError


def test_shipped_local_cluster():
    spec = ClusterSpec.load("clusters/local-3.yaml")
    assert [d.name for d in spec.daemons] == ["a", "b", "c"]
    assert all(d.is_local and d.device == "cpu" for d in spec.daemons)


def test_sizes():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512 MB") == 512 * 10**6 and parse_size(1000) == 1000
    with pytest.raises(HpipeError, match="memory size"):
        parse_size("lots")


@pytest.mark.parametrize("body,match", [
    ("daemons: []", "daemons: List should have at least 1 item"),
    ("daemons:\n  - name: a\n", "daemons.0.address: missing"),
    ("- a\n- b\n", "expected a mapping of keys at the top, found a list"),
    ("name: x\ndaemon:\n  - {address: '127.0.0.1:1'}\n", "daemon: not a key hpipe knows here"),
    ("daemons:\n  - {address: '127.0.0.1:1'}\nTurbo: 1\n", r"c\.yaml: Turbo: not a key hpipe knows here"),
    ("daemons:\n  - {address: '127.0.0.1:1'}\nlinks: [1]\n", "links: Input should be a valid dictionary"),
    ("daemons:\n  - {address: '127.0.0.1:1', emulate: {rate: fast}}\n", "daemons.0.emulate.rate: should be a rate"),
    ("daemons:\n  - address: nohostport\n", "not host:port"),
    ("daemons:\n  - address: 127.0.0.1:1\n    device: tpu\n", "not cpu or cuda"),
    ("daemons:\n  - {name: a, address: '127.0.0.1:1'}\n  - {name: a, address: '127.0.0.1:2'}\n", "duplicate"),
    ("daemons: [", "not valid YAML"),
])
def test_bad_files(tmp_path, body, match):
    p = tmp_path / "c.yaml"
    p.write_text(body)
    with pytest.raises(HpipeError, match=match):
        ClusterSpec.load(p)


def test_daemon_options_defined_once_round_trip_through_the_daemon_command(tmp_path):
    """A cluster file's daemon, turned into `hpipe daemon` flags by the launcher and parsed back by
    the CLI, is the same set of options (they are defined once, in DaemonOptions)."""
    from dataclasses import fields

    from hpipe.app.cli import build_parser
    from hpipe.core.cluster import DaemonOptions

    (tmp_path / "t.token").write_text("s3cret")
    path = tmp_path / "c.yaml"
    path.write_text("token_file: t.token\nmodel_dirs: [/srv/models, /data/llm]\ndaemons:\n"
                    "  - {name: a, address: '127.0.0.1:50151', threads: 2, memory_budget: 1GiB, cuda_graphs: false}\n"
                    "  - {name: b, address: '[::1]:7', device: 'cuda:1', model_dirs: /opt/m}\n")
    for d in ClusterSpec.load(path).daemons:
        options = d.options()
        args = build_parser().parse_args(["daemon", *options.argv()])
        parsed = {f.name: getattr(args, f.name) for f in fields(DaemonOptions)}
        assert DaemonOptions.from_values({k: v for k, v in parsed.items() if v is not None}) == options
    a = ClusterSpec.load(path).daemon("a")
    assert a.port == 50151 and a.threads == 2 and a.memory_budget == 2**30 and not a.cuda_graphs
    assert a.token_file == tmp_path / "t.token" and a.address == "127.0.0.1:50151"
    assert ClusterSpec.load(path).daemon("b").address == "[::1]:7"
    assert a.model_dir_list == ("/srv/models", "/data/llm")  # the cluster's, unless a daemon sets its own
    assert ClusterSpec.load(path).daemon("b").model_dir_list == ("/opt/m",)


@pytest.mark.parametrize("entry,match", [
    ("{name: a, address: '127.0.0.1:99999'}", "outside 0-65535"),
    ("{name: a, address: '127.0.0.1:1', threads: 0}", "threads must be >= 1"),
    ("{name: a, address: '127.0.0.1:1', threads: two}", "threads 'two' is not valid"),
    ("{name: a, address: '127.0.0.1:1', turbo: 1}", "unknown settings \\['turbo'\\]"),
    ("{name: a, address: '127.0.0.1:1', token_file: x}", "set for the whole cluster"),
    ("{name: a, address: '127.0.0.1:1', cuda_graphs: 'no'}", "cuda_graphs 'no' is not valid"),
    ("{name: a, address: '127.0.0.1:1', tls_cert: a.pem}", "go together"),
    ("{name: a, address: '127.0.0.1:1', memory_share: 1.5}", "memory share is a fraction in \\(0, 1\\]"),
])
def test_bad_daemon_entries(tmp_path, entry, match):
    p = tmp_path / "c.yaml"
    p.write_text(f"daemons:\n  - {entry}\n")
    with pytest.raises(HpipeError, match=match):
        ClusterSpec.load(p)


def test_bundled_clusters_are_found_by_name():
    from hpipe.core.cluster import bundled_clusters

    assert {"local-3", "emulated-hetero", "mps-3", "paper-hpipe"} <= set(bundled_clusters())
    assert ClusterSpec.load("local-3").daemons == ClusterSpec.load("clusters/local-3.yaml").daemons
    with pytest.raises(HpipeError, match="bundled clusters: "):
        ClusterSpec.load("no-such-cluster")


def test_ssh_entries(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "name: s\ndaemons:\n"
        "  - {name: a, address: '10.0.0.1:5000', ssh: me@10.0.0.1}\n"
        "  - {name: b, address: '10.0.0.2:5000', ssh: {to: me@10.0.0.2, port: 2222, key: k, hpipe: /v/bin/hpipe}}\n"
        "  - {name: c, address: '127.0.0.1:5000'}\n")
    a, b, c = ClusterSpec.load(tmp_path / "c.yaml").daemons
    assert a.ssh == {"to": "me@10.0.0.1"} and c.ssh == {}
    assert b.ssh == {"to": "me@10.0.0.2", "port": 2222, "key": str(tmp_path / "k"), "hpipe": "/v/bin/hpipe"}
    assert "--ssh" not in " ".join(b.options().argv())  # how to reach it is the launcher's, not the daemon's
    for bad in ("10.0.0.1", "{to: me@h, password: x}", "{port: 22}"):
        (tmp_path / "c.yaml").write_text(f"name: s\ndaemons:\n  - {{name: a, address: '10.0.0.1:5000', ssh: {bad}}}\n")
        with pytest.raises(HpipeError, match="daemons.0.ssh(.to|.password)?: (should be user@host|not a key|missing)"):
            ClusterSpec.load(tmp_path / "c.yaml")


def test_daemons_that_share_a_gpu_get_a_share_of_its_memory(tmp_path):
    """Daemons on one machine's one GPU that set no memory size get their gpu_share (scaled to fit
    where the percentages pass 100) or equal parts; a daemon alone on its device, a CPU daemon and a
    daemon that sizes itself are left as they are."""
    path = tmp_path / "c.yaml"

    def shares(lines: str) -> dict:
        path.write_text("daemons:\n" + lines)
        return {d.name: d.memory_share for d in ClusterSpec.load(path).daemons}

    mps = shares("  - {name: a, address: '127.0.0.1:1', device: 'cuda:0', emulate: {gpu_share: 50}}\n"
                 "  - {name: b, address: '127.0.0.1:2', device: 'cuda:0', emulate: {gpu_share: 30}}\n"
                 "  - {name: c, address: '127.0.0.1:3', device: 'cuda:0', emulate: {gpu_share: 20}}\n"
                 "  - {name: d, address: '127.0.0.1:4', device: 'cuda:1'}\n"
                 "  - {name: e, address: '127.0.0.1:5', device: cpu}\n"
                 "  - {name: f, address: '127.0.0.1:6', device: cpu}\n")
    assert mps == {"a": 0.5, "b": 0.3, "c": 0.2, "d": None, "e": None, "f": None}
    over = shares("  - {name: a, address: '127.0.0.1:1', device: 'cuda:0', emulate: {gpu_share: 100}}\n"
                  "  - {name: b, address: '127.0.0.1:2', device: 'cuda:0', emulate: {gpu_share: 60}}\n")
    assert over == {"a": 100 / 160, "b": 60 / 160}
    equal = shares("  - {name: a, address: '127.0.0.1:1', device: 'cuda:0'}\n"
                   "  - {name: b, address: '127.0.0.1:2', device: 'cuda:0', emulate: {gpu_share: 60}}\n"
                   "  - {name: c, address: '127.0.0.1:3', device: 'cuda:0', memory_budget: 4GiB}\n"
                   "  - {name: d, address: '127.0.0.1:4', device: 'cuda:0', memory_share: 0.1}\n"
                   "  - {name: e, address: '10.0.0.2:5', device: 'cuda:0', ssh: u@10.0.0.2}\n")
    assert equal == {"a": 0.25, "b": 0.25, "c": None, "d": 0.1, "e": None}  # e: another machine's GPU


def test_one_loopback_test_for_daemons_clusters_and_the_server():
    """Every 127.x address, ::1 (with or without brackets) and localhost are loopback; a name or
    an address of another interface is not (the daemons' bind warning, a cluster's token rule and
    ``hpipe serve``'s key rule all ask :func:`is_loopback`)."""
    from hpipe.core.cluster import is_loopback
    from runtime.daemon.servicer import bind_warning

    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host) and bind_warning(host) is None, host
    for host in ("0.0.0.0", "10.0.0.2", "::", "fe80::1", "127.example.com", "localhost.evil", ""):
        assert not is_loopback(host) and bind_warning(host), host
