"""Telling a failure of the Hub (an HTTP error it answered, or a network failure on the way) from other errors."""

from __future__ import annotations

# Top-level packages of the HTTP clients huggingface_hub uses (httpx, its vendored fork, or requests, depending on
# the version) and of their transports.
_HTTP_CLIENT_PACKAGES = ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3", "h11", "h2")


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of the answer `exc` carries, None when it carries none (httpx raises RuntimeError for the
    `request`/`response` of an exception built without them)."""
    try:
        return getattr(getattr(exc, "response", None), "status_code", None)
    except Exception:
        return None


def network_failure(exc: BaseException) -> BaseException | None:
    """The network failure (refused or dropped connection, timeout, DNS, offline mode) behind `exc`, or None.

    huggingface_hub and transformers wrap a refused connection in errors that do not say so: `hf_hub_download`
    raises LocalEntryNotFoundError (an EntryNotFoundError) from httpx's ConnectError, `from_pretrained` an
    OSError from that. So the search follows `__cause__` (`raise ... from`), and `__context__` of an OSError (an
    I/O error re-raised without `from`), not that of other exceptions: a bug in a handler that ran after a
    network failure is still a bug. An HTTP error (HfHubHTTPError, or one that carries an answer) is not a network
    failure itself."""
    from huggingface_hub.errors import HfHubHTTPError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if not isinstance(exc, HfHubHTTPError) and status_code(exc) is None:
            if isinstance(exc, (ConnectionError, TimeoutError)):
                return exc
            if any(c.__module__.split(".")[0] in _HTTP_CLIENT_PACKAGES for c in type(exc).__mro__):
                return exc
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__ if isinstance(exc, OSError) else None
    return None


def is_hub_exception(exc: BaseException) -> bool:
    """An HTTP error answered by the Hub, or a network failure behind `exc` (see `network_failure`)."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) or network_failure(exc) is not None:
        return True
    # an OSError that names a failed connection without chaining the exception that caused it
    return isinstance(exc, OSError) and "connect" in str(exc).lower()
