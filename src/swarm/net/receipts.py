"""Receipts: a trainer's signature on each gradient it hands a replica to accumulate.

Replicas of a stage tell each other, in every all-reduce round, which microbatches their gradients hold
and how many samples each carries; every member then records them as stepped (see swarm.core.ledger), and
the step's mean is divided by their samples. Without proof a member could list microbatches it never held:
another trainer's (whose real gradient is then turned away as a duplicate, and lost), or samples that were
never computed. So the trainer signs, with its peer identity (see swarm.net.identity), which microbatch
it gives which replica of which stage, with how many samples; the replica keeps the receipt with the
gradient, lists it in the round, and the round's owners check every one against the trainer's public
key, which the microbatch's ledger key (`TRAINER_PEER_ID/REQ`) embeds.
"""

from __future__ import annotations

import base64
import binascii

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import MSGPackSerializer

from swarm.net.identity import public_key_of

RECEIPT_CHARS = 88  # an Ed25519 signature in base64


def sign_receipt(key: Ed25519PrivateKey, ledger_key: str, stage: int, holder: str, samples: int) -> str:
    """The receipt for the microbatch `ledger_key` (this trainer's id, "/", the request id) given to
    `holder` of `stage` to accumulate, carrying `samples` samples."""
    return base64.b64encode(key.sign(_signed(ledger_key, stage, holder, samples))).decode()


def receipt_valid(receipt: object, ledger_key: str, stage: int, holder: str, samples: int) -> bool:
    """Whether `receipt` is the trainer's signature for exactly this gradient at this holder."""
    trainer = public_key_of(ledger_key.split("/", 1)[0])
    if trainer is None or not isinstance(receipt, str) or len(receipt) != RECEIPT_CHARS:
        return False
    try:
        trainer.verify(base64.b64decode(receipt, validate=True), _signed(ledger_key, stage, holder, samples))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


class ReceiptSigner:
    """This trainer's receipts: `signer(req, stage, holder, samples)`."""

    def __init__(self, key: Ed25519PrivateKey, me: str):
        self.key, self.me = key, me

    def __call__(self, req: str, stage: int, holder: str, samples: int) -> str:
        return sign_receipt(self.key, f"{self.me}/{req}", stage, holder, samples)


def _signed(ledger_key: str, stage: int, holder: str, samples: int) -> bytes:
    return b"swarm receipt" + MSGPackSerializer.dumps([ledger_key, stage, holder, samples])
