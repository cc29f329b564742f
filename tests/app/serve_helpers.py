"""``hpipe serve``'s app on a thread of the test, over in-process or real daemons."""

import contextlib
import socket
import threading
import time

import httpx

from hpipe.app.openai_api import create_app
from hpipe.core.plan import Plan, Stage, StrategyPlan
from hpipe.core.units import UnitRange


def tiny_plan(source, daemons, max_len: int = 64, cuts: tuple[int, ...] = (3,)) -> Plan:
    """A plan of ``source`` cut at ``cuts`` over ``daemons`` (anything with ``name`` and ``address``)."""
    cfg = source.config
    bounds = [0, *cuts, cfg.num_units]
    stages = tuple(Stage(d.name, d.address, UnitRange(a, b, cfg.num_layers))
                   for d, a, b in zip(daemons, bounds, bounds[1:]))
    sp = StrategyPlan("hpipe", stages, 1, (max_len,), 1.0)
    return Plan(str(source.path), cfg, "float32", 1, max_len, max_len, 16, "hpipe", {"hpipe": sp},
                {16 * k: (16 * k,) for k in range(1, max_len // 16 + 1)})


def await_served(base: str, server, timeout_s: float) -> None:
    """Wait until the ``hpipe serve`` process ``server`` answers ``/health`` 200 at ``base``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.ConnectError:
            pass
        assert server.poll() is None, server.stderr.read() if server.stderr else "hpipe serve exited"
        assert time.monotonic() < deadline, f"hpipe serve not healthy within {timeout_s} s"
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(backend, start: bool = True):
    """The app of ``backend`` on a free loopback port (its base URL), started as ``hpipe serve`` does
    it: uvicorn answers (``/health`` 503) while the backend deploys."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # /health is 503 while loading
        try:
            if httpx.get(f"{base}/health").status_code == 503:
                break
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if start:
        backend.start()
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)
        backend.stop()


def pools_empty(pipe, within_s: float = 5.0) -> bool:
    """Whether every KV pool of ``pipe`` holds nothing but the prefix cache's blocks within
    ``within_s`` (closes travel behind the answer)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(p.used_blocks == p.cached_blocks for p in pipe.pools()):
            return True
        time.sleep(0.05)
    return False
