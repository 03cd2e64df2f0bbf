"""Peer identities, and DHT records that only their writer can write.

Every peer holds an Ed25519 key, libp2p's identity: its peer id ("12D3KooW...") embeds the public key,
so anyone can check a signature against the id alone, with nothing else to look up or trust. A record
stored under a peer id as its subkey (a server's, a trainer's, a backup's announcement) is signed by that
peer's key (`PeerSignatures.sign_value`), and every DHT node checks the signature before it stores the
record, and again before a read returns it: a peer can write under its own id only. Records under other
subkeys (data blocks, which trainers take over from each other) are not signed here.

The key lives in `net.identity_path` when one is set (the peer id then survives restarts), else in a
file made for the run of this process and removed once the daemon has read it.
"""

from __future__ import annotations

import base64
import functools
import os
import tempfile
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

SIGNATURE_MARK = b"[sig:"
SIGNATURE_BYTES = len(SIGNATURE_MARK) + 88 + 1  # the mark, 64 bytes in base64, "]"
MAX_LIFETIME = 31 * 24 * 3600.0  # seconds any record may be stored for (the longest we write: 30 days)
# seconds a peer's signed record may be stored for: announcements, renewed every few seconds. Short, so that
# identities that stop renewing (a flood of them, see swarm.net.storage) leave the keys they filled soon
SIGNED_LIFETIME = 600.0


class IdentityError(ValueError):
    """The identity file cannot serve (another key type, or unreadable)."""


def load_or_create(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 key in `path` (libp2p's key file format), created there if the file does not exist."""
    if path.exists():
        try:
            stored = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        except Exception as e:
            raise IdentityError(f"{path} is not a key file: {e}") from e
        if stored.key_type != crypto_pb2.KeyType.Ed25519 or len(stored.data) != 64:
            raise IdentityError(f"{path} holds a key of another type ({stored.key_type}); swarm identities are "
                                "Ed25519 keys: remove the file and a new one is made (the peer id changes)")
        return Ed25519PrivateKey.from_private_bytes(stored.data[:32])
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes_raw() + _raw(key.public_key())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw).SerializeToString())
    return key


def temporary_identity() -> tuple[Path, Ed25519PrivateKey]:
    """A fresh key in a file of its own, for a peer without `net.identity_path`."""
    folder = Path(tempfile.mkdtemp(prefix="swarm-id-"))
    path = folder / "identity.key"
    return path, load_or_create(path)


def peer_id_of(key: Ed25519PublicKey) -> str:
    """The libp2p peer id of a public key: the key itself, as an identity multihash, in base58."""
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=_raw(key)).SerializeToString()
    return base58.b58encode(bytes([0, len(proto)]) + proto).decode()


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> Ed25519PublicKey | None:
    """The public key a peer id embeds; None for anything else (an id of another key type, or garbage)."""
    try:
        raw = base58.b58decode(peer_id)
        if len(raw) < 2 or raw[0] != 0 or raw[1] != len(raw) - 2:
            return None
        proto = crypto_pb2.PublicKey.FromString(raw[2:])
        if proto.key_type != crypto_pb2.KeyType.Ed25519 or len(proto.data) != 32:
            return None
        return Ed25519PublicKey.from_public_bytes(proto.data)
    except Exception:
        return None


class PeerSignatures(RecordValidatorBase):
    """Records whose subkey is a peer id must be signed by that peer and live at most SIGNED_LIFETIME; no
    record may outlive MAX_LIFETIME."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self._own_subkey = MSGPackSerializer.dumps(peer_id_of(key.public_key()))

    def __getstate__(self) -> dict:  # the validator travels to the DHT's process
        return {"key": self._key.private_bytes_raw(), "own": self._own_subkey}

    def __setstate__(self, state: dict) -> None:
        self._key, self._own_subkey = Ed25519PrivateKey.from_private_bytes(state["key"]), state["own"]

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.subkey != self._own_subkey:
            return record.value
        signature = base64.b64encode(self._key.sign(_signed_bytes(record)))
        return record.value + SIGNATURE_MARK + signature + b"]"

    def validate(self, record: DHTRecord) -> bool:
        if record.expiration_time > get_dht_time() + MAX_LIFETIME:
            return False
        owner = _owner(record.subkey)
        if owner is None:
            return True  # not a peer's own record
        if record.expiration_time > get_dht_time() + SIGNED_LIFETIME:
            return False
        value, signature = _split(record.value)
        if signature is None:
            return False
        try:
            owner.verify(base64.b64decode(signature), _signed_bytes(DHTRecord(record.key, record.subkey, value,
                                                                              record.expiration_time)))
        except (InvalidSignature, ValueError):
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        return _split(record.value)[0]

    @property
    def priority(self) -> int:
        return 10  # checked before anything reads the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerSignatures)


class DecodableValues(RecordValidatorBase):
    """Only values that deserialize: hivemind's read of one that does not never completes (the reader
    hangs), and a stranger could store one under any key. Checked last, on the value as it will be read."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        return True

    @property
    def priority(self) -> int:
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, DecodableValues)


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _owner(subkey: bytes | None) -> Ed25519PublicKey | None:
    if subkey is None or len(subkey) > 128:
        return None
    try:
        name = MSGPackSerializer.loads(subkey)
    except Exception:
        return None
    return public_key_of(name) if isinstance(name, str) else None


def _split(value: bytes) -> tuple[bytes, bytes | None]:
    """A stored value and its signature (None if it carries none)."""
    tail = value[-SIGNATURE_BYTES:]
    if len(value) >= SIGNATURE_BYTES and tail.startswith(SIGNATURE_MARK) and tail.endswith(b"]"):
        return value[:-SIGNATURE_BYTES], tail[len(SIGNATURE_MARK):-1]
    return value, None


def _signed_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps((record.key, record.subkey, record.value, record.expiration_time))
