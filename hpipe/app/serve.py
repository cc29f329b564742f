"""``hpipe serve``: the OpenAI-compatible API over a deployed plan, on uvicorn.

Binding beyond loopback requires an API key (``--api-key-file``), as the daemons' token is
required there; the key guards every ``/v1/`` route (``/health`` and ``/metrics`` stay open for
probes and scrapers).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from hpipe.core.cluster import is_loopback
from hpipe.core.errors import InputError

log = logging.getLogger(__name__)


def read_key(path: str | None) -> str | None:
    if not path:
        return None
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the API key file {path}: {e}") from None
    if not key:
        raise InputError(f"the API key file {path} is empty")
    return key


def serve(plan, cluster, source, *, host: str, port: int, api_key: str | None, policy: str, max_queue: int,
          max_running: int = 256,
          model_name: str | None = None, default_max_tokens: int = 1024, grace_s: float = 60.0,
          drain_s: float = 10.0, dequantize: bool = False, prefix_cache: float | None = 1.0,
          metrics_public: bool = False, speculate: str = "off") -> int:
    """Serve until SIGINT or SIGTERM: then stop accepting, give running requests ``drain_s`` seconds
    to finish, cancel the rest and return the exit code: 0, or 1 if the engine itself failed (so
    that a supervisor restarts the server). The caller ends the process with it
    (:func:`hpipe.app.cli.leave`), once it has let go of what it holds (daemons it started)."""
    import uvicorn

    from hpipe.app.openai_api import create_app
    from hpipe.app.serve_backend import Backend

    if not is_loopback(host) and not api_key:
        raise InputError(f"binding {host} serves anyone who can reach it: give an --api-key-file")
    server: uvicorn.Server | None = None

    def fatal() -> None:
        if server is not None:
            server.should_exit = True

    backend = Backend(plan, cluster, source, policy=policy, max_queue=max_queue, max_running=max_running,
                      api_key=api_key,
                      model_name=model_name, default_max_tokens=default_max_tokens, grace_s=grace_s,
                      on_fatal=fatal, dequantize=dequantize, prefix_cache=prefix_cache, speculate=speculate)
    server = uvicorn.Server(uvicorn.Config(create_app(backend, metrics_public), host=host, port=port,
                                           log_level="warning",
                                           timeout_graceful_shutdown=drain_s))

    def terminated(signum, frame):
        # uvicorn drains on SIGTERM, then raises it again once it is done: by then it means "exit 0",
        # after the backend has stopped (and before uvicorn runs, it means just that too)
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, terminated)
    backend.start()
    log.warning("hpipe serve: %s on http://%s:%d/v1 (%d stages, policy %s)", backend.model_name, host, port,
                len(plan.chosen.stages), policy)
    try:
        server.run()
    except SystemExit:
        # uvicorn re-raises SIGTERM once it has drained, and ours turns it into this: it must not
        # escape past the caller's leave() into the interpreter's teardown, which can abort (exit -6)
        pass
    finally:
        backend.stop()
    if backend.fatal:
        log.error("exiting: %s", backend.fatal)
    return 1 if backend.fatal else 0
