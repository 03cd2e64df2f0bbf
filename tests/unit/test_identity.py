"""Identities and signed records: a record under a peer id is valid only when that peer signed it."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.net.identity import (
    MAX_LIFETIME,
    SIGNED_LIFETIME,
    DecodableValues,
    IdentityError,
    PeerSignatures,
    load_or_create,
    peer_id_of,
    public_key_of,
    temporary_identity,
)


def record(subkey: str, value: dict, expires_in: float = 30.0) -> DHTRecord:
    return DHTRecord(b"key-id", MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value),
                     get_dht_time() + expires_in)


def signer() -> tuple[PeerSignatures, str]:
    key = Ed25519PrivateKey.generate()
    return PeerSignatures(key), peer_id_of(key.public_key())


def test_a_peer_id_embeds_its_public_key() -> None:
    path, key = temporary_identity()
    shutil.rmtree(path.parent)
    me = peer_id_of(key.public_key())
    assert me.startswith("12D3KooW")
    assert public_key_of(me).public_bytes_raw() == key.public_key().public_bytes_raw()
    for other in ("QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco", "", "12D3KooW", "not base58 0OIl"):
        assert public_key_of(other) is None


def test_only_the_owner_can_write_under_its_id() -> None:
    mine, me = signer()
    theirs, them = signer()
    own = record(me, {"epoch": 3})
    signed = DHTRecord(own.key, own.subkey, mine.sign_value(own), own.expiration_time)
    assert theirs.validate(signed) and mine.validate(signed)
    assert theirs.strip_value(signed) == own.value
    assert not theirs.validate(own)  # unsigned
    forged = DHTRecord(own.key, own.subkey, theirs.sign_value(own), own.expiration_time)
    assert forged.value == own.value and not mine.validate(forged)  # theirs does not sign under my id
    # nor does a signature carry over to another value, key or expiry
    for changed in (dict(value=MSGPackSerializer.dumps({"epoch": 10**9}) + signed.value[-94:]),
                    dict(key=b"another-key"), dict(expiration_time=own.expiration_time + 60)):
        assert not mine.validate(DHTRecord(**{**signed.__dict__, **changed}))


def test_records_not_under_a_peer_id_are_left_unsigned_but_expiry_is_capped() -> None:
    mine, _ = signer()
    block = record("17", {"owner": "x"})
    assert mine.sign_value(block) == block.value and mine.validate(block)
    assert not mine.validate(record("17", {"owner": "x"}, expires_in=MAX_LIFETIME + 60))


def test_a_signed_record_lives_at_most_the_signed_lifetime() -> None:
    mine, me = signer()
    for expires_in, kept in ((SIGNED_LIFETIME - 30, True), (SIGNED_LIFETIME + 30, False)):
        own = record(me, {"epoch": 3}, expires_in=expires_in)
        assert mine.validate(DHTRecord(own.key, own.subkey, mine.sign_value(own), own.expiration_time)) is kept


def test_the_validator_travels_to_the_dht_process_with_its_key() -> None:
    mine, me = signer()
    copy = pickle.loads(pickle.dumps(mine))
    own = record(me, {"epoch": 1})
    assert mine.validate(DHTRecord(own.key, own.subkey, copy.sign_value(own), own.expiration_time))


def test_an_identity_file_keeps_its_key_and_one_of_another_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    first = load_or_create(path)
    assert load_or_create(path).private_bytes_raw() == first.private_bytes_raw()
    rsa = tmp_path / "rsa.key"
    rsa.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=b"x" * 1200).SerializeToString())
    with pytest.raises(IdentityError, match="Ed25519"):
        load_or_create(rsa)


def test_a_value_that_does_not_deserialize_is_refused() -> None:
    """hivemind's read of such a value never completes: it must not be stored, nor returned."""
    check = DecodableValues()
    assert check.validate(record("17", {"ok": 1}))
    assert not check.validate(DHTRecord(b"key-id", MSGPackSerializer.dumps("17"), b"\xc1garbage", get_dht_time() + 5))
