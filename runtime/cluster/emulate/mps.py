"""Emulated GPUs of different speeds on one card: each CUDA daemon a CUDA MPS client limited to
``gpu_share`` percent of the GPU's SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). ``cluster up``
starts an MPS control daemon whose pipe and log folders live in the cluster's state folder. MPS
needs no root. Measured on an H100: two 50% clients each ran at about 61% of full speed at once,
a 25% client at about a third.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError
from runtime.cluster.emulate.state import State

log = logging.getLogger(__name__)


def uses_mps(cluster: ClusterSpec) -> bool:
    return any("gpu_share" in d.emulate for d in cluster.daemons)


def mps_env(record: State) -> dict[str, str]:
    base = record.path.parent / "mps"
    return {"CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}


def setup_mps(cluster: ClusterSpec, record: State) -> None:
    """Start this cluster's MPS control daemon, unless it already runs."""
    if not uses_mps(cluster):
        return
    env = mps_env(record)
    state = record.read()
    if state.get("mps") and Path(env["CUDA_MPS_PIPE_DIRECTORY"], "control").exists():
        return
    for folder in env.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=30)
    except FileNotFoundError:
        raise HpipeError("gpu_share needs CUDA MPS, but nvidia-cuda-mps-control is not on this machine's PATH; "
                         "remove gpu_share to run the daemons without it") from None
    if r.returncode != 0:
        raise HpipeError(f"could not start the CUDA MPS control daemon: {(r.stderr or r.stdout).strip()}")
    state["mps"] = env
    record.write(state)
    log.info("MPS control daemon started (pipe %s)", env["CUDA_MPS_PIPE_DIRECTORY"])


def daemon_env(cluster: ClusterSpec, record: State, d: DaemonSpec) -> dict[str, str]:
    """Environment a daemon starts with: MPS pipe and share for CUDA daemons of an MPS cluster."""
    if not (uses_mps(cluster) and d.device.startswith("cuda")):
        return {}
    env = mps_env(record)
    if "gpu_share" in d.emulate:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(d.emulate["gpu_share"])
    return env


def teardown(state: dict) -> list[str]:
    env = state.get("mps")
    if not env:
        return []
    try:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env={**os.environ, **env},
                       capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        log.warning("could not stop the MPS control daemon: %s", e)
        return []
    return ["mps control daemon"]
