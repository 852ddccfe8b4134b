"""The per-deployment secret that keys prompt and API-key digests before anything keeps them.

The middleware sends unkeyed SHA-256 digests over the probe socket; the sidecar replaces
each with ``HMAC-SHA256(secret, kind + "\\0" + digest)`` (its first 16 hex digits) before
it stores, compares or labels anything. Without the secret a stored hash cannot confirm a
guessed prompt or key; with one secret, equal prompts still get equal hashes (duplicates
are found). The secret lives only in the sidecar: vLLM's API server never needs it.

It is read at start from ``--hash-key-file``, or from ``<data dir>/hash.key``, which is
generated (32 random bytes, hex, mode 0600) when absent. It is never logged. Sidecars that
write to one store should share one file (a Kubernetes Secret, for example), or their
hashes will not match each other.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

KEY_FILE_NAME = "hash.key"
MIN_KEY_BYTES = 16


def read_key(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace dropped); ValueError if too short."""
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"hash key file {path} holds {len(key)} bytes; "
                         f"at least {MIN_KEY_BYTES} are needed")
    return key


def load_or_create(path: str | None, data_dir: str) -> bytes:
    """The secret from ``path``, else from the data directory, generating it there once."""
    if path:
        return read_key(path)
    default = os.path.join(data_dir, KEY_FILE_NAME)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    try:
        fd = os.open(default, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_key(default)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return read_key(default)


class Keyer:
    """Turns an unkeyed digest into the stored hash; "" stays "" (nothing was sent)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a hash key needs at least {MIN_KEY_BYTES} bytes")
        self._key = key

    def __call__(self, kind: str, digest: str) -> str:
        if not digest:
            return ""
        msg = f"{kind}\0{digest}".encode("utf-8", "surrogatepass")
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:16]

    def __repr__(self) -> str:
        return "Keyer(<secret>)"
