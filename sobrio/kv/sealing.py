"""Per-tenant encryption of offloaded KV blocks: AES-256-GCM, keys derived with HKDF from a master key.

A tenant's key is HKDF-SHA256(master key; salt = the tenant's random key material; info = the tenant id).
The material lives in the disk tier's keyring file (it is not secret without the master key): forgetting a
tenant deletes its material, after which none of its blocks can be decrypted again, even with the master
key (crypto-shredding). Each write takes a fresh 96-bit nonce; the associated data binds the ciphertext to
its block hash, tenant, model and cache layout, so a block moved to another tenant, position or model fails
authentication, as does a flipped byte or a wrong master key. Nothing here logs a key.
"""

import hashlib
import json
import os
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sobrio.errors import ConfigError

MASTER_KEY_ENV = "SOBRIO_KV_MASTER_KEY"
NONCE_BYTES = 12


def read_master_key(key_file: str | None) -> bytes | None:
    """The master key: `SOBRIO_KV_MASTER_KEY` (hex) or the key file's (hex text or 32 raw bytes); None if
    neither is given. A malformed one is a configuration error that never shows the key."""
    if key_file is not None:
        try:
            raw = Path(key_file).read_bytes()
        except OSError as exc:
            raise ConfigError(f"--kv-offload-key-file {key_file}: {exc.strerror or exc}",
                              option="--kv-offload-key-file") from None
        key = raw if len(raw) == 32 else _hex_key(raw.decode("ascii", "replace").strip(), "--kv-offload-key-file")
        return key
    text = os.environ.get(MASTER_KEY_ENV)
    return None if not text else _hex_key(text.strip(), MASTER_KEY_ENV)


def _hex_key(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"{where}: the KV master key must be 32 bytes, as 64 hex digits", option=where)
    return key


def tenant_digest(tenant: str) -> bytes:
    """A tenant id (its cache salt, "" for none) as 16 bytes: what files and the keyring name it by."""
    return hashlib.sha256(b"sobrio-kv-tenant|" + tenant.encode()).digest()[:16]


class TenantKeys:
    """AES-GCM per tenant; the key material in `keyring` (a JSON file, or memory only when None)."""

    def __init__(self, master: bytes, keyring: Path | None = None):
        assert len(master) == 32
        self.master = master
        self.keyring = keyring
        self.lock = threading.Lock()
        self.material: dict[str, str] = self._read_keyring()
        self.ciphers: dict[bytes, AESGCM] = {}

    def _read_keyring(self) -> dict[str, str]:
        if self.keyring is None or not self.keyring.is_file():
            return {}
        try:
            data = json.loads(self.keyring.read_text())
            return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # an unreadable keyring: every block on disk is a miss, and is rewritten

    def _write_keyring(self) -> None:
        if self.keyring is None:
            return
        tmp = self.keyring.with_suffix(".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(self.material, f)
        tmp.replace(self.keyring)

    def cipher(self, digest: bytes, create: bool) -> AESGCM | None:
        """The tenant's cipher; None when it has no material and `create` is False (nothing to read)."""
        with self.lock:
            if digest in self.ciphers:
                return self.ciphers[digest]
            material = self.material.get(digest.hex())
            if material is None:
                if not create:
                    return None
                material = self.material[digest.hex()] = os.urandom(32).hex()
                try:
                    self._write_keyring()
                except OSError:
                    pass  # a read-only tier: its blocks are written nowhere either
            key = HKDF(algorithm=hashes.SHA256(), length=32, salt=bytes.fromhex(material),
                       info=b"sobrio-kv-block|" + digest).derive(self.master)
            self.ciphers[digest] = AESGCM(key)
            return self.ciphers[digest]

    def forget(self, digest: bytes) -> bool:
        """Delete the tenant's material: its blocks are unreadable from now on. True if it had some."""
        with self.lock:
            self.ciphers.pop(digest, None)
            had = self.material.pop(digest.hex(), None) is not None
            if had:
                try:
                    self._write_keyring()
                except OSError:
                    pass
            return had


def seal(cipher: AESGCM, data: bytes, associated: bytes) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return nonce + cipher.encrypt(nonce, data, associated)


def unseal(cipher: AESGCM, blob: bytes, associated: bytes) -> bytes | None:
    """The plaintext, or None when the blob fails authentication (tampered, truncated, wrong key)."""
    if len(blob) < NONCE_BYTES + 16:
        return None
    try:
        return cipher.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], associated)
    except InvalidTag:
        return None
