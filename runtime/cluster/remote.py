"""Daemons on other machines: ``hpipe cluster up|down`` reaches them over SSH (paramiko).

A daemon whose cluster-file entry names ``ssh: user@host`` (or ``ssh: {to, port, key,
known_hosts, hpipe}``) is started on that machine: key-based login (the key file, else the
user's agent and default keys), the host checked against ``known_hosts`` (the user's, and the
file the entry names; an unknown host is refused, never trusted on first sight). ``cluster up``
checks that the remote hpipe is this one's version, copies the cluster's token file there (mode
600), and starts the daemon under ``systemd-run --user`` where the user has a systemd, else under
``setsid nohup`` in a shell loop; either restarts it when it dies, at most
:data:`~runtime.cluster.processes.MAX_RESTARTS` times in
:data:`~runtime.cluster.processes.RESTART_WINDOW_S`, as the local supervisor does. Its log and
state lie in ``~/.cache/hpipe/remote/UNIT`` there. ``cluster down`` stops it the same way.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from pathlib import Path

from hpipe import __version__
from hpipe.core.cluster import DaemonSpec
from hpipe.core.errors import HpipeError
from runtime.cluster.processes import MAX_RESTARTS, RESTART_WINDOW_S

CONNECT_TIMEOUT_S = 10.0


class Remote:
    """An SSH session with the machine of daemon ``d`` of cluster ``cluster_name``."""

    def __init__(self, d: DaemonSpec, cluster_name: str):
        import paramiko

        self.d, self.to = d, d.ssh["to"]
        user, host = self.to.split("@", 1)
        self.hpipe = d.ssh.get("hpipe", "hpipe")
        self.unit = re.sub(r"[^A-Za-z0-9_.-]", "-", f"hpipe-{cluster_name}-{d.name}")
        self.client = paramiko.SSHClient()
        self.client.load_system_host_keys()
        try:
            if d.ssh.get("known_hosts"):
                self.client.load_host_keys(d.ssh["known_hosts"])
            self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            self.client.connect(host, port=int(d.ssh.get("port", 22)), username=user, key_filename=d.ssh.get("key"),
                                allow_agent=True, look_for_keys=not d.ssh.get("key"), timeout=CONNECT_TIMEOUT_S,
                                banner_timeout=CONNECT_TIMEOUT_S, auth_timeout=CONNECT_TIMEOUT_S)
        except (paramiko.SSHException, OSError) as e:
            self.client.close()
            raise HpipeError(f"daemon {d.name}: cannot log in to {self.to} over SSH: {e}") from None
        self.state = posixpath.join(self.run("echo $HOME")[1].strip(), ".cache", "hpipe", "remote", self.unit)

    def run(self, command: str, timeout: float = 60.0) -> tuple[int, str]:
        """Run ``command`` there: its exit status and its output (stdout and stderr)."""
        _, out, err = self.client.exec_command(command, timeout=timeout)
        text = out.read().decode(errors="replace") + err.read().decode(errors="replace")
        return out.channel.recv_exit_status(), text

    def _write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` there, readable by its owner alone (no SFTP subsystem needed)."""
        stdin, out, err = self.client.exec_command(f"umask 077 && cat > {shlex.quote(path)}", timeout=30.0)
        stdin.write(data)
        stdin.channel.shutdown_write()
        if out.channel.recv_exit_status() != 0:
            raise HpipeError(f"daemon {self.d.name}: cannot write {path} on {self.to}: "
                             f"{err.read().decode(errors='replace').strip()}")

    def check_version(self) -> None:
        rc, out = self.run(f"{self.hpipe} --version")
        theirs = out.strip().split()[-1] if rc == 0 and out.strip() else ""
        if rc != 0:
            raise HpipeError(f"daemon {self.d.name}: `{self.hpipe} --version` failed on {self.to} ({out.strip()[-300:]}); "
                             "install hpipe there, or name its command in the entry (ssh: {hpipe: ...})")
        if theirs != __version__:
            raise HpipeError(f"daemon {self.d.name}: {self.to} has hpipe {theirs}, this machine {__version__}: "
                             "the wire format may differ; install the same version there")

    def start(self, token_file: Path | None) -> str:
        """Start the daemon (after :meth:`check_version`); how it runs there."""
        rc, out = self.run(f"mkdir -p {shlex.quote(self.state)} && chmod 700 {shlex.quote(self.state)}")
        if rc != 0:
            raise HpipeError(f"daemon {self.d.name}: cannot make {self.state} on {self.to}: {out.strip()}")
        options = self.d.options()
        if token_file is not None:
            remote_token = posixpath.join(self.state, "token")
            self._write(remote_token, Path(token_file).read_bytes())
            options = type(options)(**{**vars(options), "token_file": Path(remote_token)})
        command = f"{self.hpipe} daemon {shlex.join(options.argv())}"
        if self.run("systemctl --user show-environment", timeout=15.0)[0] == 0:
            rc, out = self.run(f"systemd-run --user --unit={self.unit} -p Restart=on-failure -p RestartSec=2 "
                               f"-p StartLimitBurst={MAX_RESTARTS} -p StartLimitIntervalSec={RESTART_WINDOW_S:.0f} "
                               f"{command}")
            how = f"systemd unit {self.unit}"
        else:
            loop = (f"n=0; t0=$(date +%s); while :; do {command}; rc=$?; [ $rc -eq 0 ] && exit 0; "
                    f"now=$(date +%s); [ $((now - t0)) -gt {RESTART_WINDOW_S:.0f} ] && {{ n=0; t0=$now; }}; "
                    f"n=$((n + 1)); [ $n -gt {MAX_RESTARTS} ] && {{ echo hpipe: gave up after {MAX_RESTARTS} "
                    f"restarts; exit $rc; }}; echo hpipe: the daemon exited with $rc, restarting; sleep 2; done")
            # only the daemon's loop goes to the background, its output to the log: the SSH channel closes
            rc, out = self.run(f"cd {shlex.quote(self.state)} || exit 1; setsid nohup sh -c {shlex.quote(loop)} "
                               f"> daemon.log 2>&1 < /dev/null & echo $! > pid")
            how = f"nohup, log {self.state}/daemon.log"
        if rc != 0:
            raise HpipeError(f"daemon {self.d.name}: cannot start it on {self.to}: {out.strip()[-500:]}")
        return f"started on {self.to} ({how})"

    def stop(self) -> str:
        pid = posixpath.join(self.state, "pid")
        rc, out = self.run(f"test -f {pid} && kill -TERM -- -$(cat {pid}) && rm -f {pid}")
        if rc == 0:
            return f"stopped on {self.to}"
        rc, out = self.run(f"systemctl --user stop {self.unit}", timeout=30.0)
        return f"stopped on {self.to}" if rc == 0 else f"not running on {self.to}"

    def log_tail(self) -> str:
        rc, out = self.run(f"tail -c 2000 {shlex.quote(self.state)}/daemon.log 2>/dev/null || "
                           f"journalctl --user -u {self.unit} -n 30 --no-pager")
        return out

    def close(self) -> None:
        self.client.close()
