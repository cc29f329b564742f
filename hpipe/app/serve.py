"""``hpipe serve``: the OpenAI-compatible API over a deployed plan, on uvicorn.

Binding beyond loopback requires an API key (``--api-key-file``), as the daemons' token is
required there; the key guards every ``/v1/`` route (``/health`` and ``/metrics`` stay open for
probes and scrapers).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hpipe.core.cluster import LOOPBACK
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
          model_name: str | None = None) -> int:
    import uvicorn

    from hpipe.app.openai_api import create_app
    from hpipe.app.serve_backend import Backend

    if host not in LOOPBACK and not host.startswith("127.") and not api_key:
        raise InputError(f"binding {host} serves anyone who can reach it: give an --api-key-file")
    backend = Backend(plan, cluster, source, policy=policy, max_queue=max_queue, api_key=api_key,
                      model_name=model_name)
    app = create_app(backend)
    backend.start()
    log.warning("hpipe serve: %s on http://%s:%d/v1 (%d stages, policy %s)", backend.model_name, host, port,
                len(backend.pipe.stages), policy)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        backend.stop()
    return 0
