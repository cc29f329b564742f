"""Cluster files (``clusters/*.yaml``): which daemons exist, where, on what device.

```yaml
name: local-3
token_file: secret.txt        # optional, relative to this file: every RPC must carry it
tls_ca: ca.pem                # optional: verify daemons' TLS certificates against this
daemons:
  - name: a
    address: 127.0.0.1:50151
    device: cpu               # cpu | cuda:N
    threads: 1                # torch CPU threads (optional)
    memory_budget: 2GiB       # optional cap on weights + KV cache
    cuda_graphs: false        # optional: GPU decode steps eagerly instead of as CUDA graphs
    tls_cert: a.pem           # optional, with tls_key
    tls_key: a.key
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hpipe.errors import HpipeError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.I)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _spec(path, i, spec) -> dict:
    if not spec:
        return {}
    need = ("peak_tflops", "mem_bw_gbs", "memory")
    if not isinstance(spec, dict) or any(k not in spec for k in need):
        raise HpipeError(f"{path}: daemon #{i}: spec needs {', '.join(need)}")
    return {**spec, "memory": parse_size(spec["memory"])}


def parse_size(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise HpipeError(f"cannot read memory size {value!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


@dataclass(frozen=True)
class DaemonSpec:
    name: str
    address: str
    device: str = "cpu"
    threads: int | None = None
    memory_budget: int | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    cuda_graphs: bool = True  # decode steps as CUDA graphs on a GPU daemon
    emulate: dict = field(default_factory=dict, hash=False, compare=False)
    #: published specs for what-if planning: peak_tflops, mem_bw_gbs, memory, efficiency, overhead_us
    spec: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def is_local(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    daemons: tuple[DaemonSpec, ...]
    path: Path | None = None
    token_file: Path | None = None
    tls_ca: Path | None = None
    #: what-if links: {same_host: {gbit_s, latency_ms}, between_hosts: {...}, pairs: [{src, dst, ...}]}
    links: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not self.daemons:
            raise HpipeError(f"cluster {self.name!r} lists no daemons")
        for kind in ("name", "address"):
            values = [getattr(d, kind) for d in self.daemons]
            dup = {v for v in values if values.count(v) > 1}
            if dup:
                raise HpipeError(f"cluster {self.name!r}: duplicate daemon {kind}s {sorted(dup)}")

    def daemon(self, name: str) -> DaemonSpec:
        for d in self.daemons:
            if d.name == name:
                return d
        raise HpipeError(f"cluster {self.name!r} has no daemon named {name!r}")

    @classmethod
    def load(cls, path: str | Path) -> "ClusterSpec":
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as e:
            raise HpipeError(f"cannot read cluster file: {e}") from None
        except yaml.YAMLError as e:
            raise HpipeError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("daemons"), list):
            raise HpipeError(f"{path}: a cluster file needs a 'daemons' list")
        base = path.resolve().parent

        def rel(p):
            return (base / p) if p else None

        daemons = []
        for i, d in enumerate(raw["daemons"]):
            if not isinstance(d, dict) or "address" not in d:
                raise HpipeError(f"{path}: daemon #{i} needs at least an address (host:port)")
            addr = str(d["address"])
            if not re.match(r"^[^:\s]+:\d+$|^\[[0-9a-fA-F:]+\]:\d+$", addr):
                raise HpipeError(f"{path}: daemon #{i}: address {addr!r} is not host:port")
            device = str(d.get("device", "cpu"))
            if not re.match(r"^(cpu|cuda(:\d+)?)$", device):
                raise HpipeError(f"{path}: daemon #{i}: device {device!r} is not cpu or cuda:N")
            daemons.append(DaemonSpec(
                name=str(d.get("name", f"d{i}")), address=addr, device=device,
                threads=int(d["threads"]) if d.get("threads") else None,
                memory_budget=parse_size(d.get("memory_budget")),
                tls_cert=rel(d.get("tls_cert")), tls_key=rel(d.get("tls_key")),
                cuda_graphs=bool(d.get("cuda_graphs", True)),
                emulate=dict(d.get("emulate") or {}),
                spec=_spec(path, i, d.get("spec")),
            ))
        return cls(name=str(raw.get("name", path.stem)), daemons=tuple(daemons), path=path.resolve(),
                   token_file=rel(raw.get("token_file")), tls_ca=rel(raw.get("tls_ca")),
                   links=dict(raw.get("links") or {}))

    def link_specs(self) -> dict[tuple[str, str], tuple[float, float]]:
        """What-if links as {(src, dst): (latency s, bandwidth bytes/s)} for every directed pair."""
        def conv(entry, what):
            try:
                return float(entry.get("latency_ms", 0.1)) / 1e3, float(entry["gbit_s"]) * 1e9 / 8
            except (KeyError, TypeError, ValueError):
                raise HpipeError(f"cluster {self.name!r}: link {what} needs gbit_s (and optional latency_ms)") from None

        pairs = {(p["src"], p["dst"]): conv(p, f"{p.get('src')}->{p.get('dst')}")
                 for p in self.links.get("pairs", [])}
        out = {}
        for a in self.daemons:
            for b in self.daemons:
                if a is b:
                    continue
                if (a.name, b.name) in pairs:
                    out[a.name, b.name] = pairs[a.name, b.name]
                    continue
                kind = "same_host" if a.host == b.host else "between_hosts"
                if kind not in self.links:
                    raise HpipeError(f"cluster {self.name!r}: no '{kind}' link spec for {a.name}->{b.name}")
                out[a.name, b.name] = conv(self.links[kind], kind)
        return out

    def security(self):
        from runtime.channels import Security

        return Security.from_files(self.token_file, self.tls_ca)
