"""Private swarms: a secret every member holds (`net.secret_path`) keeps strangers out.

hivemind 1.1.12 has no libp2p private-network key, so anyone who can reach a peer can open connections
to it and speak the DHT's protocol. With a secret:

- every value this peer stores in the DHT is encrypted and authenticated with a key derived from it
  (ChaCha20-Poly1305, bound to the record's key, subkey and expiry): strangers read nothing but
  ciphertext, and every member's DHT node refuses to store, or to return, a value not sealed with it;
- every call of the swarm's own protocol (stage calls, greetings) carries a token that proves the caller
  holds the secret, bound to the caller's and the callee's peer ids (which libp2p authenticates), and a
  call without a valid one is refused before its payload is read.

What it does not cover: the DHT's routing calls (find, ping) still answer strangers, who can therefore
see that peers exist and at which addresses; a member that leaks the secret lets anyone in, and the
secret cannot be revoked short of every member restarting with a new one. See SECURITY.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

MIN_SECRET_BYTES = 16
SEALED = b"SWS1"  # marks a sealed value (and the scheme's version)
NONCE_BYTES = 12
AUTH_KEY = "auth"  # where a call's token travels in its metadata


class SecretError(ValueError):
    """The secret file cannot be used."""


class SwarmSecret:
    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"a swarm secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._records = hmac.new(secret, b"swarm records", hashlib.sha256).digest()
        self._calls = hmac.new(secret, b"swarm calls", hashlib.sha256).digest()

    @classmethod
    def from_file(cls, path: str) -> SwarmSecret:
        try:
            return cls(Path(path).read_bytes().strip())
        except OSError as e:
            raise SecretError(f"cannot read the swarm secret: {e}") from e

    def token(self, caller: str, callee: str) -> str:
        """What `caller` sends `callee` to show it holds the secret (libp2p vouches for both ids)."""
        return hmac.new(self._calls, f"{caller}>{callee}".encode(), hashlib.sha256).hexdigest()[:32]

    def admits(self, caller: str, callee: str, token: object) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.token(caller, callee))

    def __getstate__(self) -> dict:  # the record validator travels to the DHT's process
        return {"records": self._records, "calls": self._calls}

    def __setstate__(self, state: dict) -> None:
        self._records, self._calls = state["records"], state["calls"]

    def seal(self, record: DHTRecord) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return SEALED + nonce + ChaCha20Poly1305(self._records).encrypt(nonce, record.value, _bound(record))

    def open(self, record: DHTRecord) -> bytes | None:
        value = record.value
        if not value.startswith(SEALED) or len(value) < len(SEALED) + NONCE_BYTES + 16:
            return None
        nonce, sealed = value[len(SEALED):len(SEALED) + NONCE_BYTES], value[len(SEALED) + NONCE_BYTES:]
        try:
            return ChaCha20Poly1305(self._records).decrypt(nonce, sealed, _bound(record))
        except InvalidTag:
            return None


def load_secret(path: str) -> SwarmSecret | None:
    return SwarmSecret.from_file(path) if path else None


class SealedRecords(RecordValidatorBase):
    """Every value sealed with the swarm's secret: members store and return nothing else."""

    def __init__(self, secret: SwarmSecret):
        self.secret = secret

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.secret.seal(record)

    def validate(self, record: DHTRecord) -> bool:
        return self.secret.open(record) is not None

    def strip_value(self, record: DHTRecord) -> bytes:
        opened = self.secret.open(record)
        return record.value if opened is None else opened

    @property
    def priority(self) -> int:
        return 5  # sealed first, then signed (swarm.net.identity): the signature covers the sealed value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SealedRecords)


def _bound(record: DHTRecord) -> bytes:
    """What a sealed value is tied to: it cannot be moved to another key, subkey or expiry."""
    return MSGPackSerializer.dumps((record.key, record.subkey, record.expiration_time))
