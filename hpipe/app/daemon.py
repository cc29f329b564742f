"""``hpipe daemon``: one device served as a pipeline stage, with the profiler beside it.

This is where the daemon is put together: the stage service (:mod:`runtime.daemon.servicer`), the
profiler's service (:mod:`profiler.service`), and the name an emulated device's CPU quota finds
its worker thread by (:mod:`runtime.cluster.emulate`).
"""

from __future__ import annotations

import gc
import logging
import shlex
import signal
import sys
import threading
from pathlib import Path

import grpc
import torch

from hpipe.app.inputs import check_device
from hpipe.core.cluster import DaemonOptions
from hpipe.model.kernels import library
from profiler import service as profiler_service
from runtime.cluster.emulate import WORKER_THREAD_NAME, name_this_thread
from runtime.daemon.servicer import bind_warning, build_server
from runtime.daemon.stage_server import StageServer

log = logging.getLogger(__name__)


def build(options: DaemonOptions) -> tuple[grpc.Server, StageServer, int]:
    """The daemon's server (not started), its stage server, and its port."""
    return build_server(options, services=(profiler_service.add_to,),
                        on_worker_start=lambda: name_this_thread(WORKER_THREAD_NAME))


def serve(options: DaemonOptions) -> int:
    """Serve until SIGTERM or SIGINT."""
    check_device(options.device)  # before a memory share is taken of it
    options.refuse_open_binding()
    if options.threads:
        torch.set_num_threads(options.threads)
    warning = bind_warning(options.host)
    if warning:
        log.warning("%s", warning)
    server, stage, port = build(options)
    server.start()
    log.warning("hpipe daemon %s serving %s on %s:%d (pid-safe stop: SIGTERM)%s", options.name, options.device,
                options.host, port, _decode_path(options.device))
    # what the imports made lives as long as the daemon: leave it out of every later collection
    # (a deployment's memory checks collect garbage; a full pass over torch's and transformers'
    # objects took 0.17 s of a Load, 0.5 s on a 30% CPU share)
    gc.freeze()
    stopped = threading.Event()

    def on_signal(signum, frame):
        log.warning("signal %d: stopping", signum)
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopped.wait()
    stage.shutdown()
    server.stop(grace=3).wait()
    return 0


def _decode_path(device: str) -> str:
    """How a CPU daemon's float32 decode micro-batches will run (loading the kernel now, if built)."""
    if not device.startswith("cpu"):
        return ""
    if library.switched_off():
        return f"; float32 decode eagerly ({library.ENV}=off)"
    if library.available():
        return "; float32 decode through the C++ kernel"
    return "; float32 decode eagerly (the C++ kernel is not built here: python -m hpipe.model.kernels)"


def systemd_unit(options) -> str:
    """A systemd service running ``hpipe daemon`` with ``options``, restarted when it fails (a
    bounded number of times, as ``hpipe cluster up``'s supervisor does for local daemons)."""
    from runtime.cluster.launcher import MAX_RESTARTS, RESTART_WINDOW_S

    command = " ".join(shlex.quote(str(a)) for a in [sys.executable, "-m", "hpipe", "daemon", *options.argv()])
    return f"""# hpipe daemon {options.name or options.address}: save as /etc/systemd/system/hpipe-daemon.service, then
#   systemctl daemon-reload && systemctl enable --now hpipe-daemon
[Unit]
Description=hpipe pipeline stage daemon {options.name or ''} on {options.address}
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec={RESTART_WINDOW_S:.0f}
StartLimitBurst={MAX_RESTARTS}

[Service]
ExecStart={command}
WorkingDirectory={Path.cwd()}
Restart=on-failure
RestartSec=2
KillSignal=SIGTERM
TimeoutStopSec=15

[Install]
WantedBy=multi-user.target"""
