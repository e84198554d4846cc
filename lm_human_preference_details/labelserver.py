"""The labeling web app of `label_generation.py serve` (Starlette): pages, a JSON API, access control.

Pages: `/` (labeling) and `/stats` (agreement figures); the only other files served are the fixed assets of
labelserver_static/, by name. API: GET /api/info, /api/next?labeler=NAME, /api/stats; POST /api/judge, /api/skip,
/api/undo with a JSON body. A judgement is fsync'ed to the judgements log (labelstore.LabelStore) before the reply
confirms it, so a page never shows the next row of a judgement that is not on disk.

Access: on a loopback address only loopback clients with a loopback Host header (no DNS rebinding) are served; on any
other address every API request needs the access token (header X-Label-Token), printed once at start. POSTs must be
JSON (a cross-site form cannot send one without a preflight this server never answers). Model text is untrusted: the
pages put it into the DOM as text only, and the Content-Security-Policy forbids inline scripts.
"""

import ipaddress
import json
import secrets
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lm_human_preference_details.agreement import agreement_report
from lm_human_preference_details.labelstore import (
    COMPARE_SCALE,
    MAJORITY_RULE,
    RATING_SCALE,
    JudgementError,
    LabelStore,
)

TOKEN_HEADER = "X-Label-Token"
MAX_BODY_BYTES = 16_384
"""largest request body accepted (a judgement is under 200 bytes)"""
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/stats": ("stats.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/stats.js": ("stats.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
"""URL -> (file of labelserver_static/, content type): the only files served"""
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def access_token(host: str, token: str | None) -> str | None:
    """The token the server requires: --token, else a random one on a non-loopback --host, else none."""
    if token is not None:
        if len(token) < 16:
            raise ValueError("--token must be at least 16 characters; leave it out to get a random one.")
        return token
    return None if is_loopback(host) else secrets.token_urlsafe(24)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=SECURITY_HEADERS)


def _host_name(host_header: str) -> str:
    """The host part of a Host header (without the port)."""
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1]
    return host_header.rsplit(":", 1)[0]


def create_app(store: LabelStore, token: str | None) -> Starlette:
    """The labeling app over `store`; `token` None: loopback only (see access_token)."""
    candidates = store.candidates
    label_type = candidates.label_type

    def refused(request: Request) -> Response | None:
        """The 403 for a request this server must not answer, else None."""
        if token is not None:
            given = request.headers.get(TOKEN_HEADER, "")
            if not secrets.compare_digest(given.encode(), token.encode()):
                return _error(403, "missing or wrong access token: open the URL with ?token= printed by the server.")
            return None
        client = request.client.host if request.client else ""
        if not is_loopback(client) or not is_loopback(_host_name(request.headers.get("host", ""))):
            return _error(403, "this server only answers loopback clients; restart it with --host and use its token.")
        return None

    async def read_json(request: Request) -> dict:
        """The JSON object of a POST body; JudgementError 4xx otherwise."""
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise JudgementError(415, "send the body as JSON (Content-Type: application/json).")
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise JudgementError(413, f"request body over {MAX_BODY_BYTES} bytes.")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise JudgementError(400, "the body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise JudgementError(400, "the body must be a JSON object.")
        return data

    def api(handler):
        """Access check, JudgementError -> its 4xx, security headers."""

        async def endpoint(request: Request) -> Response:
            denied = refused(request)
            if denied is not None:
                return denied
            try:
                result = await handler(request)
            except JudgementError as e:
                return _error(e.status, str(e))
            return JSONResponse(result, headers=SECURITY_HEADERS)

        return endpoint

    async def info(request: Request) -> dict:
        low, high = {"score": RATING_SCALE, "difference": COMPARE_SCALE}.get(label_type.label_field, (1, 1))
        return {
            "label_type": label_type.name,
            "kind": label_type.label_field,
            "num_samples": label_type.num_samples,
            "instructions": candidates.instructions,
            "scale": [low, high],
            "rows": len(candidates.rows),
            "shared_rows": len(store.shared),
        }

    async def next_row(request: Request) -> dict:
        return store.next_row(request.query_params.get("labeler"))

    async def judge(request: Request) -> dict:
        data = await read_json(request)
        labeler = data.get("labeler")
        record = await run_in_threadpool(store.judge, labeler, data.get("row"), data.get("answer"))
        return {"saved": record["seq"], "next": store.next_row(labeler)}

    async def skip(request: Request) -> dict:
        data = await read_json(request)
        labeler = data.get("labeler")
        record = await run_in_threadpool(store.skip, labeler, data.get("row"))
        return {"saved": record["seq"], "next": store.next_row(labeler)}

    async def undo(request: Request) -> dict:
        data = await read_json(request)
        labeler = data.get("labeler")
        record = await run_in_threadpool(store.undo, labeler)
        return {"undone": record["row"], "next": store.next_row(labeler)}

    async def stats(request: Request) -> dict:
        with store.lock:
            judgements, skips = store.judgements(), store.skips()
        return {**agreement_report(judgements, skips), "majority_rule": MAJORITY_RULE, "rows": len(candidates.rows)}

    async def asset(request: Request) -> Response:
        name, media_type = ASSETS[request.url.path]
        content = resources.files(__package__).joinpath("labelserver_static", name).read_bytes()
        return Response(content, media_type=media_type, headers=SECURITY_HEADERS)

    async def not_found(request: Request, exc: Any) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error(status, "not found" if status == 404 else "method not allowed")

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204, headers=SECURITY_HEADERS)

    routes = [Route(path, asset, methods=["GET"]) for path in ASSETS] + [Route("/favicon.ico", no_icon)]
    routes += [
        Route("/api/info", api(info), methods=["GET"]),
        Route("/api/next", api(next_row), methods=["GET"]),
        Route("/api/stats", api(stats), methods=["GET"]),
        Route("/api/judge", api(judge), methods=["POST"]),
        Route("/api/skip", api(skip), methods=["POST"]),
        Route("/api/undo", api(undo), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
