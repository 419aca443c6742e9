"""The web dashboard: plain HTML, CSS and JavaScript modules, served as they are at `/ui`.

There is no build step: the files in `static/` are the source and what the browser loads.
The pages call the public `/v1` API with the API key the user signs in with, kept in the
browser tab's `sessionStorage` only, so they can do nothing the key could not do with curl.
"""

from importlib import resources
from pathlib import Path

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC = Path(str(resources.files("jobplane.ui") / "static"))

# The pages run only their own files and talk only to their own origin: an injected script
# could not run, nor send the key elsewhere. `no-cache` revalidates (by ETag) on every load,
# so an upgraded server never mixes old and new modules.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class Dashboard(StaticFiles):
    """The dashboard's files (`index.html` at `/ui/`), with the headers above."""

    def __init__(self) -> None:
        super().__init__(directory=STATIC, html=True)

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response
