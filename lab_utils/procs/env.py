"""The course's one reader of environment variables: ``env_flag``, ``env_int``, ``env_url`` (and ``check_url``
for a URL given as an argument). A bad value is an ``EnvError`` naming the variable and the form expected."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

TRUE_WORDS = ("1", "true", "yes")
FALSE_WORDS = ("0", "false", "no")


class EnvError(ValueError):
    """An environment variable the course cannot use; the message names it, its value and the form expected."""


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def env_flag(name: str, default: bool = False) -> bool:
    """``$name`` as a yes/no switch: 1/true/yes or 0/false/no (any case); ``default`` when unset or empty."""
    if not (raw := _env(name)):
        return default
    if raw.lower() in TRUE_WORDS:
        return True
    if raw.lower() in FALSE_WORDS:
        return False
    raise EnvError(f"{name}={raw!r}: expected one of {'/'.join(TRUE_WORDS + FALSE_WORDS)} (or unset it)")


def env_int(name: str, default: int | None = None, minimum: int | None = None) -> int | None:
    """``$name`` as an integer (>= ``minimum`` when given); ``default`` when unset or empty."""
    if not (raw := _env(name)):
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise EnvError(f"{name}={raw!r}: expected an integer{bound}")
    return value


def check_url(value: str, name: str, *, default_port: int | None = None,
              schemes: tuple[str, ...] = ("http", "https"), bare: bool = False, path_ok: bool = False) -> str:
    """``value`` (from ``$name``, or an argument called ``name``) as ``scheme://host:port[/path]``, or ``host:port``
    with ``bare``; a missing scheme means ``schemes[0]``, a missing port ``default_port``. Raises ``EnvError``
    naming ``name`` and the form expected (a bad port, no host, a path where none belongs, another scheme)."""
    form = "HOST:PORT" if bare else f"{schemes[0]}://HOST:PORT"
    example = form.replace("HOST", "127.0.0.1").replace("PORT", str(default_port or 8000))
    text = value.strip()

    def bad(why: str) -> EnvError:
        return EnvError(f"{name}={value!r}: expected {form}, e.g. {example} ({why})")

    # urlsplit reads "localhost:8000" as scheme "localhost": a value without "://" gets the default scheme first.
    parts = urllib.parse.urlsplit(text if "://" in text else f"{schemes[0]}://{text}")
    if parts.scheme not in schemes:
        raise bad(f"the scheme {parts.scheme!r} is not {' or '.join(schemes)}")
    if not parts.hostname:
        raise bad("no host")
    try:
        port = parts.port
    except ValueError:
        raise bad(f"the port {parts.netloc.rsplit(':', 1)[-1]!r} is not a number from 1 to 65535") from None
    if not (port := port or default_port):
        raise bad("no port")
    if parts.query or parts.fragment or (parts.path.strip("/") and not path_ok):
        raise bad(f"nothing may follow the port, got {text[text.index(parts.netloc) + len(parts.netloc):]!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}" if bare else f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"


def env_url(name: str, **kwargs: Any) -> str | None:
    """``$name`` checked by :func:`check_url` (same keywords); None when unset or empty."""
    raw = _env(name)
    return check_url(raw, name, **kwargs) if raw else None
