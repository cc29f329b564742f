"""Cluster files (``clusters/*.yaml``) and the options a daemon runs with, each defined once.

```yaml
name: local-3
token_file: secret.txt        # optional, relative to this file: every RPC must carry it
tls_ca: ca.pem                # optional: verify daemons' TLS certificates against this
model_dirs: [/srv/models]     # optional: every daemon's model_dirs unless it sets its own
daemons:
  - name: a
    address: 127.0.0.1:50151  # host:port the daemon binds and clients reach
    device: cpu               # cpu | cuda:N
    threads: 1                # torch CPU threads (optional)
    memory_budget: 2GiB       # optional cap on weights + KV cache
    memory_share: 0.5         # optional, instead: a share of the device's memory (daemons sharing a GPU)
    replay_budget: 512MiB     # optional: host memory for the replay logs of what its stages sent
    cuda_graphs: false        # optional: GPU decode steps eagerly instead of as CUDA graphs
    model_dirs: [/srv/models] # optional: where Load may read model files, beyond hpipe's cache
    tls_cert: a.pem           # optional, with tls_key
    tls_key: a.key
    emulate: {...}            # optional, see runtime/cluster/emulate/
    spec: {...}               # optional published specs, for `hpipe profile --simulate`
```

:class:`DaemonOptions` is the one definition of what a daemon is started with: the cluster file's
daemon entries are read into it, ``hpipe daemon``'s flags are made from its fields, and ``hpipe
cluster up`` turns it back into those flags (:meth:`DaemonOptions.argv`). The file's other keys are
declared in :class:`hpipe.core.schemas.ClusterFile`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from importlib.resources import files
from pathlib import Path

import yaml

from hpipe.core.errors import HpipeError
from hpipe.core.schemas import ClusterFile, DeviceSpec, Ssh, validated
from hpipe.core.shared_gpus import with_memory_shares

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.I)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) is this machine's loopback:
    ``localhost``, 127.0.0.0/8 or ::1. The one test of it, for daemons, clusters and the server."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

#: a daemon's default replay budget (runtime.daemon.replay_log)
REPLAY_BUDGET = 512 << 20


def parse_size(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = None if isinstance(value, bool) else _SIZE.match(str(value))
    if not m:
        raise HpipeError(f"cannot read memory size {value!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def _int(value) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)


def _bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


def _dirs(value) -> str:
    """Directories as one ``os.pathsep``-separated string (a YAML list or text)."""
    if isinstance(value, (list, tuple)):
        return os.pathsep.join(str(v) for v in value)
    if not isinstance(value, str):
        raise ValueError(value)
    return value


def _path(value) -> Path:
    return Path(value)


def _float(value) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def _option(help: str, parse=None, flag: str | None = None) -> dict:
    """Field metadata: the help text, how to read a value from text, the flag if not ``--name``."""
    return {"help": help, "parse": parse, "flag": flag}


@dataclass(frozen=True)
class DaemonOptions:
    """What a stage daemon runs with. Port 0 binds any free port (for tests)."""

    name: str = field(default="", metadata=_option("name in logs and error messages", str))
    host: str = field(default="127.0.0.1", metadata=_option("address to bind (default: loopback only)", str))
    port: int = field(default=50151, metadata=_option("port to bind", _int))
    data_port: int = field(default=0, metadata=_option(
        "port of the data plane, where activations arrive, so a firewall can allow it (default 0: any free port)",
        _int))
    device: str = field(default="cpu", metadata=_option("cpu or cuda:N", str))
    threads: int | None = field(default=None, metadata=_option("torch CPU threads", _int))
    memory_budget: int | None = field(default=None, metadata=_option("cap on weights + KV cache, e.g. 2GiB",
                                                                     parse_size))
    memory_share: float | None = field(default=None, metadata=_option(
        "share of the device's memory, in (0, 1], that weights + KV cache may take (a budget for a daemon that "
        "shares a GPU; cluster up gives such daemons their gpu_share, or equal parts)", _float))
    replay_budget: int = field(default=REPLAY_BUDGET, metadata=_option(
        "host memory for the activations each stage keeps so a restarted daemon can be rebuilt without "
        "prefilling again, e.g. 512MiB (0: none)", parse_size))
    cuda_graphs: bool = field(default=True, metadata=_option("run GPU decode steps eagerly", _bool,
                                                                             "--no-cuda-graphs"))
    model_dirs: str = field(default="", metadata=_option(
        f"directories ('{os.pathsep}'-separated) Load may read model files from, beyond hpipe's cache and "
        "built-in models", _dirs))
    token_file: Path | None = field(default=None, metadata=_option("shared secret every RPC must carry", _path))
    tls_cert: Path | None = field(default=None, metadata=_option("TLS certificate (with --tls-key)", _path))
    tls_key: Path | None = field(default=None, metadata=_option("TLS private key", _path))
    tls_ca: Path | None = field(default=None, metadata=_option("CA to verify the successor's certificate "
                                                               "(default: --tls-cert)", _path))
    insecure: bool = field(default=False, metadata=_option(
        "serve beyond loopback without a token: anyone who reaches the ports may load models and send work",
        _bool, "--insecure"))
    weights_cache: Path | None = field(default=None, metadata=_option(
        "where the weights coordinators ship this daemon are kept (default: weights/ in hpipe's cache)", _path))
    weights_cache_gb: float = field(default=50.0, metadata=_option(
        "the most the shipped weights kept may take, in GB: the least recently used go first", _float))

    def __post_init__(self) -> None:
        who = f"daemon {self.name}" if self.name else "daemon"
        if not DEVICE.match(self.device):
            raise HpipeError(f"{who}: device {self.device!r} is not cpu or cuda:N")
        for what, port in (("port", self.port), ("data port", self.data_port)):
            if not 0 <= port <= 65535:
                raise HpipeError(f"{who}: {what} {port} is outside 0-65535")
        if self.data_port and self.data_port == self.port:
            raise HpipeError(f"{who}: the data port and the RPC port are both {self.port}")
        if self.threads is not None and self.threads < 1:
            raise HpipeError(f"{who}: threads must be >= 1, got {self.threads}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise HpipeError(f"{who}: memory budget must be positive, got {self.memory_budget}")
        if self.memory_share is not None and not 0 < self.memory_share <= 1:
            raise HpipeError(f"{who}: memory share is a fraction in (0, 1], got {self.memory_share}")
        if self.replay_budget < 0:
            raise HpipeError(f"{who}: replay budget must be >= 0, got {self.replay_budget}")
        if not self.weights_cache_gb > 0:
            raise HpipeError(f"{who}: the weights cache needs a positive size, got {self.weights_cache_gb} GB")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise HpipeError(f"{who}: a TLS certificate and key go together")

    def refuse_open_binding(self) -> None:
        """A daemon bound beyond loopback without a token would run anyone's work: refused unless
        ``insecure`` says so out loud."""
        if not self.is_local and self.token_file is None and not self.insecure:
            who = f"daemon {self.name}" if self.name else "the daemon"
            raise HpipeError(f"{who} would bind {self.host} without a token: give it --token-file (token_file: in "
                             "the cluster file), or pass --insecure to serve anyone who reaches its ports")

    @property
    def model_dir_list(self) -> tuple[str, ...]:
        return tuple(d for d in self.model_dirs.split(os.pathsep) if d)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_local(self) -> bool:
        return is_loopback(self.host)

    def argv(self) -> list[str]:
        """These options as ``hpipe daemon`` flags (the ones that differ from the defaults)."""
        out = []
        for f in fields(DaemonOptions):
            value = getattr(self, f.name)
            if value == f.default and f.name != "port":  # hpipe daemon requires --port
                continue
            if isinstance(value, bool):
                out.append(f.metadata["flag"])
            else:
                out += [option_flag(f), str(value)]
        return out

    @classmethod
    def from_values(cls, values: dict, who: str = "daemon") -> "DaemonOptions":
        """Options from text or YAML values by field name, each read by its field's parser."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise HpipeError(f"{who}: unknown settings {unknown}")
        out = {}
        for name, value in values.items():
            if value is None:
                continue
            parse = known[name].metadata["parse"]
            try:
                out[name] = parse(value)
            except (TypeError, ValueError):
                raise HpipeError(f"{who}: {name} {value!r} is not valid ({known[name].metadata['help']})") from None
        try:
            return cls(**out)
        except HpipeError as e:
            raise HpipeError(f"{who}: {e}" if who != "daemon" else str(e)) from None


def option_flag(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


@dataclass(frozen=True)
class DaemonSpec(DaemonOptions):
    """A daemon as a cluster file lists it: its options, plus emulation and what-if settings."""

    emulate: dict = field(default_factory=dict, hash=False, compare=False)
    #: how ``hpipe cluster up`` reaches its machine (runtime.cluster.remote): to (user@host), port, key,
    #: known_hosts, hpipe (the command that runs hpipe there); empty: a daemon of this machine
    ssh: dict = field(default_factory=dict, hash=False, compare=False)
    #: published specs for what-if planning: peak_tflops, mem_bw_gbs, memory, efficiency, overhead_us
    spec: dict = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def at(cls, name: str, address: str, **kw) -> "DaemonSpec":
        host, port = split_address(address, f"daemon {name}")
        return cls(name=name, host=host, port=port, **kw)

    def options(self) -> DaemonOptions:
        return DaemonOptions(**{f.name: getattr(self, f.name) for f in fields(DaemonOptions)})


def memory_system(host_id: str, device: str) -> tuple[str, str]:
    """Which memory a daemon computes from, as a key: CPU daemons on one machine (``host_id``)
    share its RAM and its memory bandwidth; a GPU daemon has its GPU's (shared only by MPS
    daemons on the same GPU)."""
    return host_id, "cpu" if device.startswith("cpu") else device


def split_address(address: str, who: str) -> tuple[str, int]:
    m = re.match(r"^([^:\s\[\]]+):(\d+)$|^\[([0-9a-fA-F:]+)\]:(\d+)$", address)
    if not m:
        raise HpipeError(f"{who}: address {address!r} is not host:port")
    host = m.group(1) or m.group(3)
    return host, int(m.group(2) or m.group(4))


def _spec(spec: DeviceSpec | None) -> dict:
    return {**spec.model_dump(exclude_none=True), "memory": parse_size(spec.memory)} if spec else {}


def _ssh(ssh: str | Ssh | None, rel) -> dict:
    """``ssh: user@host`` or ``ssh: {to: user@host, port, key, known_hosts, hpipe}`` (paths relative
    to the cluster file)."""
    ssh = {"to": ssh} if isinstance(ssh, str) else ssh.model_dump(exclude_none=True) if ssh else {}
    return {**ssh, **{k: str(rel(ssh[k])) for k in ("key", "known_hosts") if ssh.get(k)}}


def bundled_clusters() -> dict[str, Path]:
    """The cluster files shipped with hpipe (``clusters/`` in the source), by name."""
    folder = Path(str(files("hpipe").joinpath("data", "clusters")))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def cluster_file(name: str | Path) -> Path:
    """``name`` as a path, or, where no such file exists, the bundled cluster of that name
    (``local-3``, ``emulated-hetero``, ...), so that an installed hpipe finds its own."""
    path = Path(name)
    if path.exists():
        return path
    shipped = bundled_clusters()
    key = path.name.removesuffix(".yaml")
    if key in shipped and (path.parent in (Path("."), Path("clusters"))):
        return shipped[key]
    raise HpipeError(f"cannot read cluster file {name}: no such file (bundled clusters: {', '.join(shipped)})")


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

    @property
    def where(self) -> str:
        """The cluster's file, or its name where it has none (for errors)."""
        return str(self.path) if self.path else f"cluster {self.name!r}"

    def daemon(self, name: str) -> DaemonSpec:
        for d in self.daemons:
            if d.name == name:
                return d
        raise HpipeError(f"cluster {self.name!r} has no daemon named {name!r}")

    @classmethod
    def load(cls, path: str | Path) -> "ClusterSpec":
        """Read a cluster file (a path, or the name of a bundled one: :func:`cluster_file`)."""
        path = cluster_file(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise HpipeError(f"cannot read cluster file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise HpipeError(f"cluster file {path} is not UTF-8 text") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise HpipeError(f"{path}: not valid YAML{at} ({getattr(e, 'problem', None) or 'syntax error'})") from None
        f = validated(ClusterFile, raw, str(path))
        try:
            return cls._of_file(f, path)
        except HpipeError as e:  # what spans keys, or a daemon's options: said with the file's name
            raise HpipeError(str(e) if str(path) in str(e) else f"{path}: {e}") from None

    @classmethod
    def _of_file(cls, f: ClusterFile, path: Path) -> "ClusterSpec":
        base = path.resolve().parent

        def rel(p):
            return (base / str(p)) if p else None

        token_file, tls_ca = rel(f.token_file), rel(f.tls_ca)
        daemons = []
        for i, d in enumerate(f.daemons):
            who = f"{path}: daemons.{i}"
            options = dict(d.model_extra or {})
            host, port = split_address(d.address, who)
            for key in ("tls_cert", "tls_key"):
                if options.get(key):
                    options[key] = rel(options[key])
            if "token_file" in options or "tls_ca" in options:
                raise HpipeError(f"{who}: token_file and tls_ca are set for the whole cluster, at the top level")
            if f.model_dirs and "model_dirs" not in options:
                options["model_dirs"] = f.model_dirs
            parsed = DaemonOptions.from_values({"name": f"d{i}", **options, "host": host, "port": port}, who)
            daemons.append(DaemonSpec(**{**vars(parsed), "token_file": token_file, "tls_ca": tls_ca},
                                      emulate=d.emulate.model_dump(exclude_none=True) if d.emulate else {},
                                      spec=_spec(d.spec), ssh=_ssh(d.ssh, rel)))
        return cls(name=f.name or path.stem, daemons=with_memory_shares(daemons), path=path.resolve(),
                   token_file=token_file, tls_ca=tls_ca, links=f.links.model_dump(exclude_none=True) if f.links else {})

    def link_specs(self) -> dict[tuple[str, str], tuple[float, float]]:
        """What-if links as {(src, dst): (latency s, bandwidth bytes/s)} for every directed pair."""
        def conv(entry, what):
            try:
                return float(entry.get("latency_ms", 0.1)) / 1e3, float(entry["gbit_s"]) * 1e9 / 8
            except (KeyError, TypeError, ValueError):
                raise HpipeError(f"{self.where}: link {what} needs gbit_s (and optional latency_ms)") from None

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
                    raise HpipeError(f"{self.where}: links: no '{kind}' link for {a.name}->{b.name} (what-if "
                                     "planning needs one)")
                out[a.name, b.name] = conv(self.links[kind], kind)
        return out
