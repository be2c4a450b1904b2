"""API keys (a bearer token, or `x-api-key`), scopes and per-key rate limits.

Routes fall in three classes (`required_scope`):
- probes (/live, /startup, /ready, /health, /models/{model}/ready) are open, so
  orchestrators never need a key, and so is /openapi.json (the API's static
  description);
- /metrics, /version, /models and /models/{model}/... need the `admin` scope;
- everything else (the OpenAI API under /v1/) needs `inference`.

With no keys configured every route is open (config.py refuses to bind a
non-loopback address then, unless the operator opts out). A missing or unknown
key is a 401, a key without the route's scope a 403, both as OpenAI error
objects. Keys are compared as SHA-256 digests with `hmac.compare_digest`, against
every configured key without stopping at a match, so timing reveals neither a
key's prefix nor which key matched. Only a key's label (its name, or a
fingerprint) is ever stored on the request, logged or used as a metric label.

Threading: event loop only.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.config import Settings
from gateway.http.errors import APIError
from gateway.http.request_state import state
from gateway.serving.admission import RateLimiter

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# /openapi.json describes the API, not this deployment, and clients read it
# before they hold a key (gateway/http/openapi.py).
PUBLIC_PATHS = frozenset({"/live", "/startup", "/ready", "/health", "/openapi.json"})
ADMIN_PATHS = frozenset({"/metrics", "/version", "/models"})


def required_scope(path: str) -> str | None:
    """The scope a path needs; None for the open probes."""
    if path in PUBLIC_PATHS:
        return None
    if path.startswith("/models/"):
        return None if path.endswith("/ready") and path.count("/") == 3 else "admin"
    if path in ADMIN_PATHS:
        return "admin"
    return "inference"


@dataclass(frozen=True, slots=True)
class KeyEntry:
    digest: bytes
    label: str
    scopes: frozenset[str]
    rate_limit_rpm: float


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self.keys = [
            KeyEntry(
                hashlib.sha256(k.key.get_secret_value().encode()).digest(),
                k.label,
                frozenset(k.scopes),
                k.rate_limit_rpm or settings.rate_limit_rpm,
            )
            for k in settings.api_keys
        ]
        self.rate_burst = settings.rate_limit_burst
        self.limiter = RateLimiter()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, presented: str) -> KeyEntry | None:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for entry in self.keys:  # no early exit: constant work per configured key
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found

    def authenticate(self, request: web.Request) -> KeyEntry | None:
        """The request's key, or raise 401/403/429; None when the route is open."""
        scope = required_scope(request.path)
        if not self.enabled or scope is None:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not token:  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "").strip()
        if not token:
            raise _unauthorized(
                "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                "missing_api_key",
            )
        entry = self.identify(token)
        if entry is None:
            raise _unauthorized("invalid API key", "invalid_api_key")
        state(request).api_key = entry.label  # the label only, never the key
        if scope not in entry.scopes:
            raise APIError(
                403, f"this API key lacks the {scope!r} scope", code="insufficient_scope"
            )
        if scope == "inference" and entry.rate_limit_rpm > 0:
            wait = self.limiter.check(entry.label, entry.rate_limit_rpm, self.rate_burst)
            if wait > 0:
                state(request).rejected = "rate_limited"
                retry = max(1, math.ceil(wait))
                raise APIError(
                    429,
                    f"rate limit of {entry.rate_limit_rpm:g} requests per minute exceeded; "
                    f"retry after {retry} s",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry)},
                )
        return entry


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


def auth_middleware(auth: Authenticator) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        auth.authenticate(request)
        return await handler(request)

    return middleware
