import pytest

from hpipe.errors import HpipeError
from runtime.cluster import ClusterSpec, parse_size


def test_shipped_local_cluster():
    spec = ClusterSpec.load("clusters/local-3.yaml")
    assert [d.name for d in spec.daemons] == ["a", "b", "c"]
    assert all(d.is_local and d.device == "cpu" for d in spec.daemons)


def test_sizes():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512 MB") == 512 * 10**6 and parse_size(1000) == 1000
    with pytest.raises(HpipeError, match="memory size"):
        parse_size("lots")


@pytest.mark.parametrize("body,match", [
    ("daemons: []", "no daemons"),
    ("daemons:\n  - name: a\n", "needs at least an address"),
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
