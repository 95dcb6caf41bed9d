"""Password records: making new ones and checking every kind a user may have.

A user keeps ``(salt, password_hash)`` (the store's and etcd's columns). Kinds,
told apart without a new column:

- ``salt == b""`` and a PHC string in ``password_hash``: the current kind.
  ``$argon2id$...`` through the installed KDF (leveret/node/passwords.py, argon2-cffi,
  OWASP's parameters m=19 MiB t=2 p=1: 26 ms a check here), or the core's own
  ``$pbkdf2-sha256$<iterations>$<salt>$<key>`` (600,000 iterations, OWASP's
  figure for PBKDF2-SHA256: 280 ms) when no KDF was installed.
- a 4-byte salt: RabbitMQ's ``rabbit_password_hashing_sha256`` (SHA-256 of salt
  + password), from imported definitions.
- a 16-byte salt: Leveret's first records (PBKDF2-SHA256, one iteration).

The last two, and records of an outdated KDF, verify and ask for a re-hash,
which ``Broker.authenticate`` does on the next successful login.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from collections.abc import Callable

from core.ports.passwords import PasswordKDF

RABBIT_SALT_BYTES = 4
LEGACY_SALT_BYTES = 16
PBKDF2_ITERATIONS = 600_000


class Pbkdf2Sha256:
    """The standard library's slow KDF: what the core uses when nothing better was installed."""

    prefix = b"$pbkdf2-sha256$"

    def __init__(self, iterations: int = PBKDF2_ITERATIONS) -> None:
        self.iterations = iterations

    def hash(self, password: str) -> bytes:
        salt = os.urandom(16)
        key = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, self.iterations)
        return b"%s%d$%s$%s" % (self.prefix, self.iterations, _b64(salt), _b64(key))

    def verify(self, record: bytes, password: str) -> bool:
        try:
            iterations, salt, key = record[len(self.prefix):].split(b"$")
            expected = base64.b64decode(key + b"==")
            derived = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), base64.b64decode(salt + b"=="),
                                          int(iterations))
        except ValueError:
            return False
        return hmac.compare_digest(derived, expected)

    def outdated(self, record: bytes) -> bool:
        try:
            return int(record[len(self.prefix):].split(b"$")[0]) < self.iterations
        except ValueError:
            return True


def _b64(raw: bytes) -> bytes:
    return base64.b64encode(raw).rstrip(b"=")


_fallback = Pbkdf2Sha256()
_kdf: PasswordKDF = _fallback
_dummy: bytes | None = None  # a record of the current KDF that no password matches


def install(kdf: PasswordKDF) -> None:
    """Make ``kdf`` hash every new password (the node installs argon2id at start)."""
    global _kdf, _dummy
    _kdf = kdf
    _dummy = None


def waste(password: str) -> None:
    """Spend what a check would (a login naming no user), so the answer's timing does not tell."""
    global _dummy
    if _dummy is None:
        _dummy = _kdf.hash(os.urandom(16).hex())
    _kdf.verify(_dummy, password)


def check(record: tuple[bytes, bytes] | None, password: str) -> tuple[bool, bool]:
    """``verify`` for a user's ``(salt, password_hash)``, or for no user (``None``), at one cost:
    every answer spends one check of the node's KDF, so its timing tells neither whether the user
    exists nor the kind of its record (an imported RabbitMQ SHA-256 record checks in a
    microsecond: 6,763 guesses/s against 35/s for argon2id). Runs in the broker's KDF threads."""
    if record is None:
        waste(password)
        return False, False
    salt, hashed = record
    result = verify(salt, hashed, password)
    if salt:  # RabbitMQ's or the first Leveret records: as slow as the KDF's
        waste(password)
    return result


def new_record(password: str) -> tuple[bytes, bytes]:
    """``(salt, password_hash)`` for a new password: the salt lives inside the PHC string."""
    return b"", _kdf.hash(password)


def verify(salt: bytes, record: bytes, password: str) -> tuple[bool, bool]:
    """``(ok, needs_rehash)``: whether ``password`` matches, and whether the record should be replaced."""
    if not salt:
        for kdf in (_kdf, _fallback):
            if record.startswith(kdf.prefix):
                ok = kdf.verify(record, password)
                return ok, ok and (kdf is not _kdf or kdf.outdated(record))
        return False, False  # a kind this node cannot check (an argon2 record with no argon2 installed)
    raw = password.encode("utf-8")
    if len(salt) == RABBIT_SALT_BYTES:
        ok = hmac.compare_digest(hashlib.sha256(salt + raw).digest(), record)
    else:
        ok = hmac.compare_digest(hashlib.pbkdf2_hmac("sha256", raw, salt, 1), record)
    return ok, ok


class RecentLogins:
    """Passwords that verified lately, so a reconnecting client does not pay the KDF every time.

    An argon2id check is 26 ms of event-loop time; 500 clients reconnecting
    after a restart would stall every connection for 13 s. A success is
    remembered as HMAC-SHA256 under a key made at start and kept only in this
    process, bound to the user's current record (a password change or a
    re-hash forgets it) and for ``ttl`` seconds. Failures are never
    remembered: each guess costs a full check (and the login throttle's wait).
    """

    def __init__(self, ttl: float = 600.0, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._key = os.urandom(32)
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[bytes, bytes, float]] = {}  # user -> (record, mac, expiry)

    def _mac(self, name: str, password: str) -> bytes:
        return hmac.new(self._key, f"{name}\0{password}".encode("utf-8", "surrogatepass"), hashlib.sha256).digest()

    def known(self, name: str, record: bytes, password: str) -> bool:
        entry = self._entries.get(name)
        if entry is None or entry[0] != record or entry[2] < self._clock():
            return False
        return hmac.compare_digest(entry[1], self._mac(name, password))

    def remember(self, name: str, record: bytes, password: str) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[name] = (record, self._mac(name, password), self._clock() + self.ttl)
