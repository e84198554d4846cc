"""The labeling web app of `label_generation.py serve` (Starlette): pages, a JSON API, access control.

Pages: `/` (labeling) and `/stats` (agreement figures); the only other files served are the fixed assets of
labelserver_static/, by name. API: GET /api/info, /api/stats (read only); POST /api/next (claims a row), /api/judge,
/api/skip, /api/undo with a JSON body. A judgement is fsync'ed to the judgements log (labelstore.LabelStore) before the
reply confirms it, so a page never shows the next row of a judgement that is not on disk; one that could not be
written (disk full) is answered 507 and is not in the log.

Access: on a loopback address only loopback clients with a loopback Host header (no DNS rebinding) are served; on any
other address every API request needs the access token, printed once at start: the header X-Label-Token (scripts), or
the HttpOnly SameSite=Strict cookie that opening `/?token=...` sets before it redirects to `/` (the URL with the token
never renders a page, so it is no page of the browser's history). Every state change is a POST of JSON (a cross-site
form or image cannot send one; the preflight it would need is never answered), and an API request that a browser marks
as coming from another origin is refused. A labeler's name is bound to a labeler key at its first use
(labelstore.LabelStore.check_key): a request under that name without the key is refused. Model text is untrusted: the
pages put it into the DOM as text only, and the Content-Security-Policy forbids inline scripts. Every answer, errors
and 500s included, carries the security headers.
"""

import ipaddress
import json
import os
import secrets
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lm_human_preference_details.labeling.agreement import agreement_report
from lm_human_preference_details.labeling.labelstore import (
    COMPARE_SCALE,
    MAJORITY_RULE,
    RATING_SCALE,
    JudgementError,
    LabelStore,
)

TOKEN_HEADER = "X-Label-Token"
TOKEN_ENV = "LHPD_LABEL_TOKEN"
"""environment variable that may hold the access token (kept out of `ps`, unlike --token)"""
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
PAGES = ("/", "/stats")
"""the pages a `?token=` URL may open"""
POLL_SECONDS = 10.0
"""a page with no row to show (all labelled, or the rest shown to others) asks again this often"""
MAX_PAIR_LABELERS = 40
"""/api/stats lists the pairs of labelers up to this many labelers sharing rows (780 pairs); `agreement` lists all"""


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def given_token(token: str | None, token_file: str | None) -> str | None:
    """The access token the user chose: --token, else the first line of --token_file, else $LHPD_LABEL_TOKEN (the
    last two keep it out of `ps`), else None."""
    if token is not None and token_file is not None:
        raise ValueError("pass --token or --token_file, not both.")
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                return f.readline().strip()
        except OSError as e:
            raise ValueError(f"--token_file '{token_file}' cannot be read ({e.strerror or e}).") from e
    return token if token is not None else os.environ.get(TOKEN_ENV) or None


def access_token(host: str, token: str | None) -> str | None:
    """The token the server requires: --token, else a random one on a non-loopback --host, else none."""
    if token is not None:
        if len(token) < 16:
            raise ValueError(
                f"the access token (--token, --token_file or ${TOKEN_ENV}) must be at least 16 characters; leave "
                "them out to get a random one."
            )
        return token
    return None if is_loopback(host) else secrets.token_urlsafe(24)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=SECURITY_HEADERS)


def _host_name(host_header: str) -> str:
    """The host part of a Host header (without the port)."""
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1]
    return host_header.rsplit(":", 1)[0]


def token_cookie(port: int | None) -> str:
    """The cookie holding the access token; named per port, as browsers share cookies between a host's ports."""
    return f"label_token_{port or 80}"


class SecurityHeaders:
    """ASGI wrapper adding SECURITY_HEADERS to every answer that lacks them (Starlette's own 404, 405, 500 included)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.lower().encode() not in present:
                        headers.append((name.lower().encode(), value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def read_json(request: Request) -> dict:
    """The JSON object of a POST body, read in chunks and refused (413) as soon as it passes MAX_BODY_BYTES; 400 for
    a body that is not a JSON object or nests too deeply; JudgementError 4xx otherwise."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise JudgementError(415, "send the body as JSON (Content-Type: application/json).")
    too_large = JudgementError(413, f"request body over {MAX_BODY_BYTES} bytes.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise JudgementError(400, "the body is not valid JSON.") from None
    except RecursionError:
        raise JudgementError(400, "the body nests too deeply; a request is one flat JSON object.") from None
    if not isinstance(data, dict):
        raise JudgementError(400, "the body must be a JSON object.")
    return data


def create_app(store: LabelStore, token: str | None, poll_seconds: float = POLL_SECONDS):
    """The labeling app over `store` (an ASGI app); `token` None: loopback only (see access_token). A page with no
    row to show asks again every `poll_seconds`."""
    candidates = store.candidates
    label_type = candidates.label_type
    stats_cache: dict = {}

    def given_token(request: Request) -> str:
        return request.headers.get(TOKEN_HEADER) or request.cookies.get(token_cookie(request.url.port), "")

    def refused(request: Request) -> Response | None:
        """The 403 for a request this server must not answer, else None."""
        if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            return _error(403, "cross-origin request refused: open the labeling page of this server itself.")
        if token is not None:
            if not secrets.compare_digest(given_token(request).encode(), token.encode()):
                return _error(403, "missing or wrong access token: open the URL with ?token= printed by the server.")
            return None
        client = request.client.host if request.client else ""
        if not is_loopback(client) or not is_loopback(_host_name(request.headers.get("host", ""))):
            return _error(403, "this server only answers loopback clients; restart it with --host and use its token.")
        return None

    def api(handler):
        """Access check, JudgementError -> its 4xx (507 for a judgement the disk could not take)."""

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
            "poll_seconds": poll_seconds,
        }

    def for_labeler(action):
        """An API handler of `action(data, labeler) -> result` that first checks the labeler key of the body's
        labeler (403 without it: LabelStore.check_key), and binds an unbound name to a new key once the action
        succeeded, adding it to the result as `labeler_key`."""

        async def handler(request: Request) -> dict:
            data = await read_json(request)
            labeler = data.get("labeler")
            unbound = store.check_key(labeler, data.get("key"))
            result = await action(data, labeler)
            new_key = await run_in_threadpool(store.issue_key, labeler) if unbound else None
            return result if new_key is None else {**result, "labeler_key": new_key}

        return handler

    async def next_row(data: dict, labeler: Any) -> dict:
        return store.next_row(labeler)

    async def judge(data: dict, labeler: Any) -> dict:
        record = await run_in_threadpool(store.judge, labeler, data.get("row"), data.get("answer"))
        return {"saved": record["seq"], "next": store.next_row(labeler)}

    async def skip(data: dict, labeler: Any) -> dict:
        record = await run_in_threadpool(store.skip, labeler, data.get("row"))
        return {"saved": record["seq"], "next": store.next_row(labeler)}

    async def undo(data: dict, labeler: Any) -> dict:
        record = await run_in_threadpool(store.undo, labeler)
        return {"undone": record["row"], "next": store.next_row(labeler)}

    def stats_report() -> dict:
        """The agreement report of the store's current state, computed once per change of the log."""
        with store.lock:
            version, judgements, skips = store.seq, store.judgements(), store.skips()
        if stats_cache.get("version") != version:
            report = agreement_report(judgements, skips, max_pair_labelers=MAX_PAIR_LABELERS)
            stats_cache.update(version=version, report=report)
        return stats_cache["report"]

    async def stats(request: Request) -> dict:
        report = await run_in_threadpool(stats_report)  # many labelers: seconds of work, off the event loop
        return {
            **report,
            "majority_rule": MAJORITY_RULE,
            "rows": len(candidates.rows),
            "export_error": store.export_error,
        }

    async def page(request: Request) -> Response:
        """A page, or for `?token=...` the cookie that carries the token and a redirect to the URL without it."""
        if "token" not in request.query_params:
            return await asset(request)
        headers = {**SECURITY_HEADERS, "Location": request.url.path}
        response = Response(status_code=303, headers=headers)
        if token is not None:
            given = request.query_params["token"]
            if not secrets.compare_digest(given.encode(), token.encode()):
                return _error(403, "wrong access token in the URL: open the URL printed by the server.")
            response.set_cookie(token_cookie(request.url.port), token, httponly=True, samesite="strict", path="/")
        return response

    async def asset(request: Request) -> Response:
        name, media_type = ASSETS[request.url.path]
        content = resources.files(__package__).joinpath("labelserver_static", name).read_bytes()
        return Response(content, media_type=media_type, headers=SECURITY_HEADERS)

    async def not_found(request: Request, exc: Any) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error(status, "not found" if status == 404 else "method not allowed")

    async def server_error(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error ({type(exc).__name__}); the server's console has the details.")

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204, headers=SECURITY_HEADERS)

    routes = [Route(path, page if path in PAGES else asset, methods=["GET"]) for path in ASSETS]
    routes += [Route("/favicon.ico", no_icon)]
    routes += [
        Route("/api/info", api(info), methods=["GET"]),
        Route("/api/stats", api(stats), methods=["GET"]),
        Route("/api/next", api(for_labeler(next_row)), methods=["POST"]),
        Route("/api/judge", api(for_labeler(judge)), methods=["POST"]),
        Route("/api/skip", api(for_labeler(skip)), methods=["POST"]),
        Route("/api/undo", api(for_labeler(undo)), methods=["POST"]),
    ]
    handlers = {404: not_found, 405: not_found, Exception: server_error}
    return SecurityHeaders(Starlette(routes=routes, exception_handlers=handlers))
