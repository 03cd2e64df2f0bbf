"""How many weight updates each gradient comes after the forward it belongs to.

Counted when an update takes the gradient in, since that is the staleness the optimizer sees: async mode
applies each gradient at its backward (a local update), sync mode at the stage's next step. In sync mode
a gradient whose forward ran before a step that its backward missed is one step late, and one whose
backward came while a round was already summing the stage's gradients without it waits for the step
after that: two steps late, although no step came between its forward and its backward.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class Staleness:
    def __init__(self, at_backward: bool):
        """`at_backward`: each gradient is applied as it is held (async); else at the step that takes it."""
        self.at_backward = at_backward
        self.counts: dict[int, int] = {}  # updates between a gradient's forward and its application -> gradients
        self._forwards: dict[str, int] = {}  # held, not yet applied: microbatch id -> version its forward ran at

    def held(self, req_id: str, forward_version: int, version: int) -> None:
        """A microbatch's gradient was accumulated, `version` being the weights' version now."""
        if self.at_backward:
            self._count(version - forward_version)
        else:
            self._forwards[req_id] = forward_version

    def applied(self, ids: Iterable[str], version: int, pending: Collection[str]) -> None:
        """A step at `version` took these microbatches' gradients in; `pending`: what the replica holds (those
        no longer held, dropped by a catch-up or a discard, are forgotten uncounted)."""
        for req_id in ids:
            forward = self._forwards.pop(req_id, None)
            if forward is not None:
                self._count(version - forward)
        self._forwards = {r: v for r, v in self._forwards.items() if r in pending}

    def _count(self, late: int) -> None:
        self.counts[late] = self.counts.get(late, 0) + 1
