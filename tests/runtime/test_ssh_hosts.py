"""`hpipe cluster up` over SSH: bare emulated hosts, each with its own sshd and an empty cache.

Each host is a network namespace of this machine (as clusters/emulated-hetero.yaml makes them)
running Debian's sshd with a host key and a user key made here. `cluster up` logs in with the
key, checks the remote hpipe's version, copies the token and starts the daemon there; the job's
deploy sends each one its units' weights (it has no model file and an empty cache); `hpipe run`
of 8 documents answers each as single-process generation does; `cluster down` stops them. Needs root, iproute2 and sshd (CI
installs openssh-server); skipped where any is missing.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from importlib.resources import files

import pytest

from hpipe.app.cli import main
from hpipe.app.jobs import build_prompt, prompt_limit
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan, StrategyPlan, stages_from_cuts
from hpipe.model.compute.layers import tensors_of
from hpipe.model.generate.local import LocalModel, generate_ids
from hpipe.model.kernels import library
from hpipe.model.weights.manifest import manifest
from runtime.cluster import emulate, launcher
from runtime.cluster.emulate import Emulation
from runtime.cluster.emulate.net import names
from runtime.cluster.processes import state_dir
from runtime.wire.channels import DaemonClient, Security
from tests.cluster_helpers import discard_state

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
UNAVAILABLE = emulate.unavailable() or (None if SSHD else "needs sshd (apt-get install openssh-server)")
HOSTS = {"h1": "198.18.0.41", "h2": "198.18.0.42", "h3": "198.18.0.43"}
INSTRUCTION = "Summarize this report in one sentence."
NEW_TOKENS = 12


def _even_plan(model: str, cfg, cluster: ClusterSpec) -> Plan:
    """A plan without a profile: the units split evenly over the hosts, prompts sliced in two."""
    n = len(cluster.daemons)
    stages = stages_from_cuts([(d.name, d.address) for d in cluster.daemons],
                              [cfg.num_units * i // n for i in range(1, n)], cfg.num_units)
    return Plan(model, cfg, "float32", 1, 256, 1024, 16, "even",
                {"even": StrategyPlan("even", tuple(stages), 1, (128, 128), 0.0)}, {})


def _documents(folder, count: int) -> list:
    paragraphs = [p for p in files("hpipe").joinpath("data/sample_report.md").read_text().split("\n\n") if p.strip()]
    out = []
    for i in range(count):
        path = folder / f"doc{i}.md"
        path.write_text("\n\n".join(paragraphs[(i + k) % len(paragraphs)] for k in range(1 + i % 3)))
        out.append(path)
    return out


def _keys(tmp_path):
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "user.pub").read_text())
    host_key = (tmp_path / "host.pub").read_text().split()
    (tmp_path / "known_hosts").write_text("".join(f"{ip} {host_key[0]} {host_key[1]}\n" for ip in HOSTS.values()))


def _sshd(tmp_path, name: str, ip: str) -> None:
    config = tmp_path / f"sshd-{name}.conf"
    config.write_text(f"ListenAddress {ip}\nPort 22\nHostKey {tmp_path / 'host'}\n"
                      f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                      f"PasswordAuthentication no\nUsePAM no\nStrictModes no\nPidFile {tmp_path / f'sshd-{name}.pid'}\n")
    subprocess.run(["mkdir", "-p", "/run/sshd"], check=True)
    subprocess.run(["ip", "netns", "exec", names(ClusterSpec.load(tmp_path / "ssh.yaml").daemon(name))[0],
                    SSHD, "-f", str(config)], check=True)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
def test_cluster_up_over_ssh_on_bare_hosts(tmp_path, smollm2):
    _keys(tmp_path)
    (tmp_path / "token").write_text("ssh-test-token")
    model = tmp_path / "models" / smollm2.gguf.name  # where no daemon may read it
    model.parent.mkdir()
    shutil.copy(smollm2.gguf, model)
    remote_cache = tmp_path / "remote-cache"  # its own cache: no model, no import; the kernels this machine built
    remote_cache.mkdir()
    (remote_cache / "kernels").symlink_to(library.cache_root() / "kernels")
    hpipe = f"env HPIPE_CACHE_DIR={remote_cache} {sys.executable} -m hpipe"
    entries = "".join(
        f"  - name: {name}\n    address: {ip}:50201\n    data_port: 50202\n    threads: 1\n"
        f"    weights_cache: {tmp_path}/weights-{name}\n"
        f"    emulate: {{rate: 1gbit}}\n"
        f"    ssh: {{to: root@{ip}, key: {tmp_path / 'user'}, known_hosts: {tmp_path / 'known_hosts'}, "
        f"hpipe: '{hpipe}'}}\n" for name, ip in HOSTS.items())
    (tmp_path / "ssh.yaml").write_text(f"name: ssh-test\ntoken_file: token\ndaemons:\n{entries}")
    cluster = ClusterSpec.load(tmp_path / "ssh.yaml")
    emu = Emulation(cluster, state_dir(cluster))
    emu.setup_network()  # the hosts exist before cluster up, as machines do
    down = None
    try:
        for name, ip in HOSTS.items():
            _sshd(tmp_path, name, ip)
        status = launcher.up(cluster, timeout_s=120)
        assert all("started on root@" in status[n] for n in HOSTS), status
        assert "already running" in launcher.up(cluster)["h1"]  # a second up leaves them be

        plan = _even_plan(str(model), smollm2.config, cluster)
        (tmp_path / "plan.json").write_text(plan.to_json())
        docs = _documents(tmp_path, 8)
        out = tmp_path / "answers.jsonl"
        assert main(["run", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "ssh.yaml"),
                     "--instruction", INSTRUCTION, "--chat", "--max-new-tokens", str(NEW_TOKENS), "-o", str(out),
                     *map(str, docs)]) == 0
        rows = {r["document"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert len(rows) == len(docs) and not any("error" in r for r in rows.values())
        tok, local = smollm2.tokenizer(), LocalModel(smollm2)
        for d in docs:  # every answer is single-process generation's
            ids, _ = build_prompt(tok, INSTRUCTION, d.read_text(), True, prompt_limit(plan), "none")
            ref = generate_ids(local.open, tok, ids, context=smollm2.config.max_position_embeddings,
                               eos_ids=smollm2.eos_token_ids(), max_new_tokens=NEW_TOKENS)
            assert rows[str(d)]["token_ids"] == ref.token_ids, d.name
        man = manifest(smollm2.gguf, smollm2.path)
        for stage in plan.chosen.stages:  # each host's cache holds its units' tensors only, sent to it
            share = sum({e.hash: e.nbytes for e in man.entries(tensors_of(smollm2.config, [stage.units]))}.values())
            held = sum(p.stat().st_size for p in (tmp_path / f"weights-{stage.daemon}").iterdir() if p.is_file())
            assert held == share, (stage.daemon, held, share)
        down = launcher.down(cluster)
        assert all("stopped on root@" in down[n] for n in HOSTS), down
        for d in cluster.daemons:
            client = DaemonClient(d.address, Security(token="ssh-test-token"))
            deadline = time.monotonic() + 15
            while client.health(timeout=1.0):
                assert time.monotonic() < deadline, f"{d.name} still serving after cluster down"
                time.sleep(0.2)
            client.close()
    finally:
        for d in cluster.daemons:  # sshd and whatever still runs on the host
            pids = subprocess.run(["ip", "netns", "pids", names(d)[0]], capture_output=True, text=True).stdout.split()
            sshd = tmp_path / f"sshd-{d.name}.pid"
            pids += [sshd.read_text().strip()] if sshd.exists() else []
            subprocess.run(["kill", "-9", *pids], capture_output=True)
        if down is None:
            launcher.down(cluster)
        discard_state(cluster)
