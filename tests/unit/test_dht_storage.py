"""The bounds every node keeps on one DHT key's entries (swarm.net.storage), on hivemind's own storage."""

from __future__ import annotations

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.utils import get_dht_time

from swarm.net import storage
from swarm.net.storage import MAX_SUBKEYS, MAX_SUBKEYS_PER_SENDER, bound_dht_storage

KEY = DHTID.generate(source="run_stage1")


def store(node: DHTLocalStorage, subkey: str, sender: str | None, expires_in: float = 60.0) -> bool:
    token = storage._sender.set(sender)
    try:
        return node.store(KEY, b"value", get_dht_time() + expires_in, subkey=subkey)
    finally:
        storage._sender.reset(token)


def entries(node: DHTLocalStorage) -> set[str]:
    return {subkey for subkey, _ in node.get(KEY).value.items()}


def test_one_sender_fills_no_more_than_its_share_of_a_key_and_renews_what_it_holds() -> None:
    bound_dht_storage()
    node = DHTLocalStorage()
    stored = [store(node, f"sybil{i}", "attacker") for i in range(MAX_SUBKEYS_PER_SENDER + 10)]
    assert stored == [True] * MAX_SUBKEYS_PER_SENDER + [False] * 10
    assert store(node, "sybil0", "attacker", expires_in=120)  # a renewal
    assert store(node, "honest", "someone else") and "honest" in entries(node)
    assert store(node, "own", None)  # this node's own write: only the key's cap applies


def test_a_full_key_refuses_newcomers_whatever_their_expiry_and_frees_slots_as_entries_expire() -> None:
    bound_dht_storage()
    node = DHTLocalStorage()
    senders = MAX_SUBKEYS // MAX_SUBKEYS_PER_SENDER
    for s in range(senders):
        for i in range(MAX_SUBKEYS_PER_SENDER):
            assert store(node, f"s{s}-{i}", f"peer{s}", expires_in=1.0 if s == 0 else 60)
    assert len(entries(node)) == MAX_SUBKEYS
    assert not store(node, "late", "newcomer", expires_in=60)
    assert not store(node, "later", "newcomer", expires_in=500)  # a longer expiry buys nothing
    assert store(node, "s1-0", "peer1", expires_in=90)  # those in still renew
    deadline = get_dht_time() + 5
    while get_dht_time() < deadline and not store(node, "late", "newcomer"):
        pass  # peer0's entries expire after 1 s
    assert "late" in entries(node) and len(entries(node)) <= MAX_SUBKEYS
