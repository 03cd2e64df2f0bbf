"""Replies to recent gradient calls, kept so that a repeated call (its first reply was lost) is answered
again without its gradient being applied twice."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

REPLY_CACHE = 32  # recent accumulating calls remembered

Reply = tuple[dict[str, Any], list[Any]]


class ReplyCache:
    def __init__(self, size: int = REPLY_CACHE):
        self.size = size
        self._replies: OrderedDict[str, Reply] = OrderedDict()

    def remember(self, key: str, reply: Reply) -> None:
        self._replies[key] = reply
        while len(self._replies) > self.size:
            self._replies.popitem(last=False)

    def repeat(self, key: str, epoch: int) -> Reply | None:
        """The reply to `key` again, with the replica's current epoch; None if it was not kept."""
        if key not in self._replies:
            return None
        meta, tensors = self._replies[key]
        return {**meta, "epoch": epoch}, tensors
