"""The optional bearer token every face of a server checks (gRPC metadata or an HTTP header, both
`authorization: Bearer <token>`), transport-free.

The token comes from `--auth-token` or the `KIMI_VISION_AUTH_TOKEN` environment variable
(`resolve_token`); the variable keeps it out of the process list. It is never logged. The
comparison is constant-time over SHA-256 digests, so neither the token's content nor its length
shows in response times. A refusal is an `Unauthenticated` error (the taxonomy's unauthenticated
kind: gRPC UNAUTHENTICATED, HTTP 401), saying what was wrong: no header, the header sent twice, a
malformed one, or a wrong token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

from service.errors import Unauthenticated

ENV_VAR = "KIMI_VISION_AUTH_TOKEN"
MIN_TOKEN_CHARS = 16


class AuthConfigError(ValueError):
    """The configured token cannot be used (empty, too short, or not sendable as metadata)."""


def check_token(token: str) -> str:
    """`token` if it can be used as a bearer token, else `AuthConfigError` saying why."""
    if len(token) < MIN_TOKEN_CHARS:
        raise AuthConfigError(f"the auth token must be at least {MIN_TOKEN_CHARS} characters "
                              f"(got {len(token)}); generate one with: python -c 'import secrets; "
                              "print(secrets.token_urlsafe(32))'")
    if not all("\x21" <= ch <= "\x7e" for ch in token):
        # gRPC metadata values are printable ASCII; a space would split "Bearer <token>".
        raise AuthConfigError("the auth token must be printable ASCII without spaces")
    return token


def resolve_token(flag_value: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token to require: `--auth-token` if given, else `$KIMI_VISION_AUTH_TOKEN`, else None (auth off)."""
    env = os.environ if environ is None else environ
    token = flag_value if flag_value is not None else env.get(ENV_VAR)
    if token is None or token == "":
        if flag_value == "":
            raise AuthConfigError("--auth-token is empty")
        return None
    return check_token(token)


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


def presented_token(authorization: Iterable[str | bytes]) -> tuple[str | None, str | None]:
    """The token in the `authorization` values a request carried, as (token, None), or (None, what
    is wrong with them): none, more than one (ambiguous: which would a proxy have checked?), or not
    `Bearer <token>`."""
    values = list(authorization)
    if not values:
        return None, "missing bearer token: send 'authorization: Bearer <token>'"
    if len(values) > 1:
        return None, (f"the authorization header was sent {len(values)} times; send 'authorization: Bearer <token>' "
                      "once")
    value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None, "malformed authorization header: send 'authorization: Bearer <token>'"
    return token.strip(), None


class BearerToken:
    """The token a server requires."""

    def __init__(self, token: str) -> None:
        self._digest = _digest(check_token(token))

    def refusal(self, authorization: Iterable[str | bytes]) -> Unauthenticated | None:
        """None when `authorization` (every value of the header a request carried) holds this
        token, else the refusal, saying why (never what was sent)."""
        token, problem = presented_token(authorization)
        # Always compare (a digest of nothing when absent), so a missing token costs the same.
        ok = hmac.compare_digest(_digest(token if token is not None else b""), self._digest)
        if ok and token is not None:
            return None
        return Unauthenticated(problem or "invalid bearer token")
