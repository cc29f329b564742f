"""The cluster page's routes: ``/`` (the page), ``/page/...`` (its script, styles and the vendored
chart library, all inside the package: no CDN, no build step) and ``/api/live`` (what the page
shows, as :class:`hpipe.app.live.Live` last encoded it).

The page and its assets hold no data and are open, so a browser can load them and ask for the key;
``/api/live`` and the chat's ``/v1/`` routes follow the server's API key rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

PAGE_DIR = Path(__file__).resolve().parent / "page"
#: the routes open without the key (they carry no data); ``/page/`` is a prefix
OPEN_PATHS = frozenset({"/"})
OPEN_PREFIX = "/page/"


def add_page(app: FastAPI, live_body: Callable[[], bytes], count: Callable[[str, int], None]) -> None:
    """Add the page to ``app``; ``live_body()`` gives the JSON of ``/api/live``; ``count(path, status)``
    counts a request in the server's metrics."""
    app.mount("/page", StaticFiles(directory=PAGE_DIR), name="page")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/live")
    async def live():
        """The cluster, the plan and the last minutes of the serving, as the page draws them."""
        count("/api/live", 200)
        return Response(live_body(), media_type="application/json", headers={"Cache-Control": "no-store"})
