"""The port for a password KDF the core may not import itself (argon2id lives outside the core).

Implemented by leveret/node/passwords.py (argon2-cffi) and installed at start with
``core.engine.passwords.install``; the core's own fallback is PBKDF2-SHA256.
"""

from __future__ import annotations

from typing import Protocol


class PasswordKDF(Protocol):
    # The prefix of the PHC strings this KDF writes and reads, e.g. "$argon2id$".
    prefix: bytes

    def hash(self, password: str) -> bytes:
        """A self-describing record (PHC string) of a fresh salt and the derived key."""
        ...

    def verify(self, record: bytes, password: str) -> bool: ...

    def outdated(self, record: bytes) -> bool:
        """True when ``record`` was made with weaker parameters than this KDF now uses."""
        ...
