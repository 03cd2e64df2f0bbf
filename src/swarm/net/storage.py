"""Bounds on what strangers can make a DHT node store under one key.

Identities cost nothing: a stranger can sign records under 10^5 fresh peer ids, each valid, and store them
all under a stage's key. Measured on loopback with hivemind's unbounded dictionaries: 10^4 such records
made every read of the key take 2.6 s; with 10^5 the reply outgrew hivemind's unary message cap and reads
came back empty, so the stage's servers vanished from every trainer's view. Every node of the swarm
therefore keeps, per key:

- at most `MAX_SUBKEYS` entries: a subkey the key does not hold yet is refused once it is full, while the
  entries it holds are renewed as usual. Whoever holds a slot keeps it only while renewing it, and
  nothing is favoured for expiring later: signed records live at most `SIGNED_LIFETIME` (see
  `swarm.net.identity`), so a flood's entries are gone within minutes of the flood stopping;
- at most `MAX_SUBKEYS_PER_SENDER` entries created by the same sending peer (libp2p authenticates it):
  an honest peer writes its own announcement and at most a data key's blocks, so a flood must come from
  many peers at once to fill a key.

Reads of a key are then bounded by `MAX_SUBKEYS` per node asked, whatever was sent. The price: a swarm
with more than `MAX_SUBKEYS` servers of one stage, or trainers, would need those records spread over
several keys.
"""

from __future__ import annotations

import contextvars
import functools
import logging

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue

from swarm.net.quiet import Quiet

log = logging.getLogger(__name__)
MAX_SUBKEYS = 1024  # entries per key: about 300 KiB of server records, a read in ~0.25 s on loopback
MAX_SUBKEYS_PER_SENDER = 64  # above a data key's 48 blocks plus the peer's own record
_sender: contextvars.ContextVar[str | None] = contextvars.ContextVar("dht_sender", default=None)
_quiet = Quiet(log)


def admits_subkey(entries: DictionaryDHTValue | None, subkey: object, sender: str | None) -> bool:
    """Whether a key's entries (None: it has none) may take `subkey` from `sender` (None: this node itself)."""
    if entries is None or subkey in entries:  # a renewal (checks and drops expired entries first)
        return True
    if len(entries.data) >= MAX_SUBKEYS:
        _quiet.warning("refusals at full DHT keys", "a DHT key is full (%d entries): new entries refused", MAX_SUBKEYS)
        return False
    if sender is None:
        return True
    creators = _creators(entries)
    mine = sum(1 for key in entries.data if creators.get(key) == sender)
    if mine >= MAX_SUBKEYS_PER_SENDER:
        _quiet.warning("refusals over a sender's entries", "peer …%s sent more than %d entries for one DHT key: "
                       "refused", sender[-6:], MAX_SUBKEYS_PER_SENDER)
        return False
    return True


def _creators(entries: DictionaryDHTValue) -> dict:
    """subkey -> the peer that created it, kept beside the entries (hivemind's value has no room for it)."""
    return entries.__dict__.setdefault("creators", {})


def _note_creator(entries: DictionaryDHTValue, subkey: object, sender: str) -> None:
    creators = _creators(entries)
    if subkey not in creators:
        for gone in [key for key in creators if key not in entries.data]:
            del creators[gone]
        creators[subkey] = sender


def bound_dht_storage() -> None:
    """Make every DHT node started after this (in this process or its forks) keep the bounds above."""
    if getattr(DHTLocalStorage.store_subkey, "bounded", False):
        return
    store_subkey, rpc_store = DHTLocalStorage.store_subkey, DHTProtocol.rpc_store

    def bounded_store_subkey(self: DHTLocalStorage, key, subkey, value, expiration_time) -> bool:
        sender = _sender.get()
        if not admits_subkey(_entries(self, key), subkey, sender):
            return False
        stored = store_subkey(self, key, subkey, value, expiration_time)
        if stored and sender is not None and (entries := _entries(self, key)) is not None:
            _note_creator(entries, subkey, sender)
        return stored

    @functools.wraps(rpc_store)  # hivemind finds the message types in its annotations
    async def sender_known_rpc_store(self: DHTProtocol, request, context):
        token = _sender.set(context.remote_id.to_base58())
        try:
            return await rpc_store(self, request, context)
        finally:
            _sender.reset(token)

    bounded_store_subkey.bounded = True
    DHTLocalStorage.store_subkey = bounded_store_subkey
    DHTProtocol.rpc_store = sender_known_rpc_store


def _entries(storage: DHTLocalStorage, key) -> DictionaryDHTValue | None:
    found = storage.get(key)
    return found.value if found is not None and isinstance(found.value, DictionaryDHTValue) else None
