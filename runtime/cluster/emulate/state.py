"""What an emulation created, recorded in the cluster's state folder so that ``cluster down`` removes it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from hpipe.core.errors import HpipeError


class State:
    """The emulation's JSON record: namespaces, bridge, cgroups, MPS."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "emulation.json"

    def read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {"netns": [], "cgroups": []}

    def write(self, state: dict) -> None:
        self.path.write_text(json.dumps(state))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise HpipeError(f"emulation step failed: {' '.join(cmd)}: {r.stderr.strip()}")
