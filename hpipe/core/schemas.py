"""The files a user hands hpipe, declared: a cluster file (YAML), ``profile.json`` and ``plan.json``.

Each file's keys, their types and ranges are declared here once, as pydantic models that refuse
keys they do not know; :func:`validated` checks a file's parsed contents against its model and
turns the first problem into one line, ``FILE: path.to.key: what is wrong``. The dataclasses the
rest of hpipe uses (:mod:`hpipe.core.cluster`, :mod:`hpipe.core.profile`, :mod:`hpipe.core.plan`)
are then built from the checked values, and check what spans keys (stages covering the model's
units, a strategy the plan has). A daemon's own settings are declared once too, by
:class:`hpipe.core.cluster.DaemonOptions` (the ``hpipe daemon`` flags): a cluster file's daemon
entry declares here only what a flag does not carry, and hands the rest to it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, Strict, StringConstraints, ValidationError

from hpipe.core.errors import HpipeError

USER_AT_HOST = r"^[^@\s]+@[^@\s]+$"
RATE = r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$"
LENGTH = r"^[1-9][0-9]{0,9}$"
#: what a value that must match a pattern should look like, said in an error
LOOKS_LIKE = {USER_AT_HOST: "user@host", RATE: "a rate like 100mbit or 1gbit", LENGTH: "a length in tokens"}

# scalars are strict (no "3" for 3, no 1 for True); sequences may be lists or tuples
Text = Annotated[str, Strict()]
Count = Annotated[int, Strict(), Field(ge=0, le=1 << 62)]
Positive = Annotated[int, Strict(), Field(ge=1, le=1 << 62)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Seconds = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Rate = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
Name = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=256)]
#: a memory size: bytes, or text such as 2GiB (hpipe.core.cluster.parse_size reads it)
Size = Annotated[int, Strict(), Field(ge=1)] | Annotated[str, Strict(), StringConstraints(max_length=64)]


class Declared(BaseModel):
    """Refuses keys it does not declare."""
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- cluster files ---------------------------------------------------------------------------
class Emulate(Declared):
    """What ``emulate:`` may set (runtime.cluster.emulate carries it out)."""
    cpus: Text | Annotated[int, Strict(), Field(ge=0)] | None = None
    cpu_quota: Annotated[float, Strict(), Field(gt=0, le=64, allow_inf_nan=False)] | None = None
    rate: Annotated[str, Strict(), StringConstraints(pattern=RATE)] | None = None
    delay_ms: Seconds | None = None
    gpu_share: Annotated[float, Strict(), Field(gt=0, le=100, allow_inf_nan=False)] | None = None


class Ssh(Declared):
    to: Annotated[str, Strict(), StringConstraints(pattern=USER_AT_HOST)]
    port: Annotated[int, Strict(), Field(ge=1, le=65535)] | None = None
    key: Text | None = None
    known_hosts: Text | None = None
    hpipe: Text | None = None


class DeviceSpec(Declared):
    """A device's published figures, for what-if planning (profiler.roofline)."""
    peak_tflops: Rate
    mem_bw_gbs: Rate
    memory: Size
    efficiency: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    overhead_us: Seconds | None = None


class DaemonEntry(BaseModel):
    """A daemon in a cluster file: its address and what no ``hpipe daemon`` flag carries; its
    other keys are the daemon's options (checked by DaemonOptions.from_values)."""
    model_config = ConfigDict(extra="allow", frozen=True)
    address: Annotated[str, Strict(), StringConstraints(min_length=1, max_length=300)]
    emulate: Emulate | None = None
    ssh: Annotated[str, Strict(), StringConstraints(pattern=USER_AT_HOST)] | Ssh | None = None
    spec: DeviceSpec | None = None


class LinkSpec(Declared):
    gbit_s: Rate
    latency_ms: Seconds = 0.1


class LinkPair(LinkSpec):
    src: Name
    dst: Name


class Links(Declared):
    """What-if links: by kind, and for named pairs."""
    same_host: LinkSpec | None = None
    between_hosts: LinkSpec | None = None
    pairs: list[LinkPair] = []


class ClusterFile(Declared):
    name: Name | None = None
    daemons: Annotated[list[DaemonEntry], Field(min_length=1)]
    token_file: Text | None = None
    tls_ca: Text | None = None
    model_dirs: Text | list[Text] | None = None
    links: Links | None = None


# --- profile.json ----------------------------------------------------------------------------
class GridFile(Declared):
    batches: Annotated[list[Count], Field(min_length=1)]
    tokens: Annotated[list[Count], Field(min_length=1)]
    contexts: Annotated[list[Count], Field(min_length=1)]
    seconds: list[list[list[Seconds]]]


class DaemonProfileFile(Declared):
    name: Name
    address: Text
    device: Text
    memory_bytes: Positive
    compute: dict[str, GridFile]
    fingerprint: Text = ""


class LinkProfileFile(Declared):
    src: Name
    dst: Name
    latency_s: Seconds
    bandwidth_Bps: Rate
    send_cpu_s: Seconds = 0.0
    send_cpu_s_per_byte: Seconds = 0.0
    recv_cpu_s: Seconds = 0.0
    recv_cpu_s_per_byte: Seconds = 0.0


Dtype = Literal["float32", "bfloat16", "float16"]


class ProfileFile(Declared):
    version: Annotated[int, Strict()]
    source: Text = "measured"
    model_name: Text
    dtype: Dtype
    model: dict[str, Any]  # a Hugging Face config.json (hpipe.core.config.ModelConfig reads it)
    meta: dict[str, Any] = {}
    daemons: Annotated[list[DaemonProfileFile], Field(min_length=1)]
    links: list[LinkProfileFile]
    weight_bits: Annotated[float, Strict(), Field(ge=0, le=64, allow_inf_nan=False)] = 0.0


# --- plan.json -------------------------------------------------------------------------------
class StageFile(Declared):
    daemon: Name
    address: Text
    unit_start: Count
    unit_end: Count
    memory_bytes: Count = 0
    memory_limit: Count = 0
    compute_s: Seconds = 0.0


class StrategyFile(Declared):
    name: Name
    stages: Annotated[list[StageFile], Field(min_length=1)]
    micro_batches: Positive
    slices: Annotated[list[Positive], Field(min_length=1)]
    predicted_s: Seconds | None  # None: it did not fit (infinite)


class PlanFile(Declared):
    version: Annotated[int, Strict()]
    model_name: Text
    model: dict[str, Any]
    dtype: Dtype
    batch: Positive
    seq_len: Positive
    max_len: Positive
    granularity: Positive
    strategy: Name
    ideal_s: Seconds = 0.0
    meta: dict[str, Any] = {}
    strategies: Annotated[dict[str, StrategyFile], Field(min_length=1)]
    # a length (as JSON keys are text) -> its slices
    slicing: dict[Annotated[str, Strict(), StringConstraints(pattern=LENGTH)],
                  Annotated[list[Positive], Field(min_length=1)]] | None = None
    slicing_for: Name = "hpipe"
    # plans written before the slicing table had its own name called it the schedule
    schedule: dict[Annotated[str, Strict(), StringConstraints(pattern=LENGTH)], list[Positive]] | None = None
    schedule_for: Name | None = None


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], raw: Any, where: str, error: type[HpipeError] = HpipeError) -> M:
    """``raw`` (a file's parsed contents) as ``model``, or ``error`` saying, on one line, where in
    the file ``where`` the first problem is and what it is."""
    if not isinstance(raw, dict):
        raise error(f"{where}: expected a mapping of keys at the top, found {_kind(raw)}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise error(describe(e, where)) from None


def describe(e: ValidationError, where: str) -> str:
    """A validation error as ``where: path.to.key: what is wrong`` (its first problem, and how many more)."""
    # a key hpipe does not know first (often a misspelt one: the one missing is then the key meant),
    # then the deepest problem (of a union's branches, the one the value came closest to)
    problems = sorted(e.errors(include_url=False), key=lambda p: (p["type"] != "extra_forbidden", -len(p["loc"])))
    first = problems[0]
    path = ".".join(str(p) for p in first["loc"] if not _is_union_branch(p))
    msg = first["msg"]
    if first["type"] == "string_pattern_mismatch":
        msg = f"should be {LOOKS_LIKE.get(first['ctx']['pattern'], 'text matching ' + first['ctx']['pattern'])}"
    if first["type"] == "extra_forbidden":
        msg = "not a key hpipe knows here"
    if first["type"] == "missing":
        msg = "missing"
    if "input" in first and first["type"] not in ("missing", "extra_forbidden"):
        msg += f" (found {_short(first['input'])})"
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return f"{where}: {path or '(top)'}: {msg}{more}"


def _is_union_branch(p) -> bool:
    """pydantic names the branch of a union it tried in the path (``str``, ``constrained-int``, a
    model's class name such as ``Ssh``): not a key of the file."""
    return isinstance(p, str) and (p in _BRANCHES or p.startswith(("constrained-", "function-")))


def _models(cls) -> set[str]:
    return {cls.__name__}.union(*(_models(c) for c in cls.__subclasses__()))


_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"} | _models(Declared) | {DaemonEntry.__name__}


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "text", type(None): "nothing"}.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
