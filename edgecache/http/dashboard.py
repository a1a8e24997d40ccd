"""``GET /dashboard``: the operator's page, served by the box itself with nothing loaded from anywhere else.

The page is three static files shipped in the package (``static/``: the HTML, its script and its style sheet, and
an icon, so the browser asks this box for that too): no build step, no charting library, no font or script from a
CDN. A rented box may have no way out, and a page that calls a CDN tells a third party who uses the box.

The page holds no figure. Its script asks ``/stats`` and ``/stats/history`` for them, with the key the operator gave
(typed into its form, or after ``#key=`` in the address: a fragment never reaches the server or its access log) in
``Authorization: Bearer``, as the API's other clients send it. So what the page shows is by construction what
``/stats`` gives that key: an admin key every tenant, a tenant's key only its own figures. The charts are SVG drawn
by the page's own script. The files are served with a Content-Security-Policy that lets the page load and connect
to its own origin only, so even a mistake in the script cannot reach out.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated

from litestar import get
from litestar.datastructures import State
from litestar.params import PathParameter
from litestar.types import ASGIApp

from edgecache.errors import NotFound
from edgecache.http.replies import RawAnswer

#: The page's files, by the name the page asks for, with their content types.
ASSETS = {
    "dashboard.js": b"text/javascript; charset=utf-8",
    "dashboard.css": b"text/css; charset=utf-8",
    "icon.svg": b"image/svg+xml",
}
PAGE = "dashboard.html"

#: Everything from this origin only; nothing inline, no frames, no form posted anywhere.
CSP = (b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = [(b"content-security-policy", CSP), (b"referrer-policy", b"no-referrer"),
            (b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-cache")]


def load_assets() -> dict[str, bytes]:
    """The page's files, read from the package once (the app keeps them on its state)."""
    static = resources.files(__package__).joinpath("static")
    return {name: static.joinpath(name).read_bytes() for name in (PAGE, *ASSETS)}


@get("/dashboard")
async def dashboard(state: State) -> ASGIApp:
    """The page: a form for the key, and the script that fetches the figures once it has one."""
    return RawAnswer(state.dashboard[PAGE], _HEADERS, content_type=b"text/html; charset=utf-8")


@get("/dashboard/{name:str}")
async def dashboard_asset(state: State, name: Annotated[str, PathParameter()]) -> ASGIApp:
    content_type = ASSETS.get(name)
    if content_type is None:
        raise NotFound(f"the dashboard has no file {name!r}")
    return RawAnswer(state.dashboard[name], _HEADERS, content_type=content_type)
