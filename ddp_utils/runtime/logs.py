"""Rank-aware logging: INFO and up on rank 0, WARNING and up on the other ranks; and the one rule
that keeps credentials out of every line a process prints (:func:`masked`), applied where a
message is made and again where lines leave: the log handler's formatter and the scripts' one-line
errors.

While a run starts, records are held back: a start that ends in a bad-input error shows only
that error's one line; a start that succeeds shows them all, in order.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys
from urllib.parse import quote, unquote

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(message)s"

# The user part of an address (scheme://USER:SECRET@host): everything up to its last "@", whatever
# it holds ("/" and "+" are common in AWS secret keys; %2F and %2B in their URL-encoded form)
_USER_PART = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)(\S*)@")
_SIGNED_QUERY = re.compile(r"(X-Amz-(?:Credential|Signature|Security-Token)=)[^&\s]+", re.IGNORECASE)
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
SHORTEST_PIECE = 8  # characters: a credential's shorter pieces are too common to mask as text
MASK = "***"
_seen_user_parts: set[str] = set()  # the user parts of every address masked so far in this process
_literals: tuple[frozenset[str], re.Pattern | None] = (frozenset(), None)


def masked(text: str) -> str:
    """``text`` with whatever could be a credential replaced by ``***``: structurally, the user
    part of every address (``s3://KEY:SECRET@bucket``, ``https://user:pass@host``) and the
    signature fields of a presigned URL; literally, every credential this process knows (the
    ``SECRET_VARIABLES``, the user part of ``AWS_ENDPOINT_URL`` and of any address masked so far),
    as typed, %-decoded and %-encoded, and each of their pieces between "/", "+" and ":" of at
    least ``SHORTEST_PIECE`` characters, wherever they appear."""
    for found in _USER_PART.finditer(text):
        if found.group(2) != MASK:
            _seen_user_parts.add(found.group(2))
    text = _SIGNED_QUERY.sub(rf"\1{MASK}", _USER_PART.sub(rf"\1{MASK}@", text))
    pattern = _literal_pattern()
    return pattern.sub(MASK, text) if pattern is not None else text


def _literal_pattern() -> re.Pattern | None:
    """One regular expression for every credential value known now (made again when they change)."""
    global _literals
    values = {os.environ.get(name, "") for name in SECRET_VARIABLES}
    endpoint = _USER_PART.search(os.environ.get("AWS_ENDPOINT_URL", ""))
    values |= {endpoint.group(2)} if endpoint else set()
    values = frozenset(values | _seen_user_parts)
    if values != _literals[0]:
        forms = set()
        for value in values:
            decoded = unquote(value)
            pieces = [decoded, *re.split(r"[/+:]", decoded)]
            forms |= {form for piece in pieces if len(piece) >= SHORTEST_PIECE for form in (piece, quote(piece, safe=""))}
        forms.discard(MASK)
        longest_first = sorted(forms, key=len, reverse=True)
        _literals = (values, re.compile("|".join(map(re.escape, longest_first)), re.IGNORECASE) if forms else None)
    return _literals[1]


class MaskingFormatter(logging.Formatter):
    """A log line, its exception's traceback included, as :func:`masked` leaves it."""

    def format(self, record: logging.LogRecord) -> str:
        return masked(super().format(record))


def say_error(line: str) -> None:
    """A script's one-line error on stderr, masked."""
    print(masked(line), file=sys.stderr, flush=True)


def setup_logging(rank: int, debug: bool = False, hold: bool = False) -> logging.Logger:
    """Configure the root logger once per process; other ranks still show their warnings.
    ``hold``: keep records until :func:`release_held_logs`."""
    level = logging.DEBUG if debug else logging.INFO
    if rank != 0:
        level = logging.WARNING
    handler: logging.Handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(MaskingFormatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    if hold:
        handler = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1,
                                                 target=handler, flushOnClose=False)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger("train")


def release_held_logs(show: bool) -> None:
    """Print (``show``) or drop the held records, and log directly from now on."""
    root = logging.getLogger()
    for i, handler in enumerate(root.handlers):
        if isinstance(handler, logging.handlers.MemoryHandler):
            if show:
                handler.flush()
            root.handlers[i] = handler.target
