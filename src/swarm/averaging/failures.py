"""How a stage all-reduce round fails on a member, and what each failure says about the group: whom the
next group should leave out."""

from __future__ import annotations

from swarm.net.directory import short
from swarm.net.transport import CallFailed


class RoundFailed(Exception):
    """This round did not complete on this member; its gradients are kept for the next try.
    `unreachable`: members no call could reach, or that sent nothing before the timeout (dead or
    frozen; the next group should leave them out)."""

    def __init__(self, message: str, unreachable: frozenset[str] = frozenset(),
                 refused_by: frozenset[str] = frozenset()):
        super().__init__(message)
        self.unreachable = unreachable
        self.refused_by = refused_by  # owners that answered our part with a refusal


class RefusedBy(CallFailed):
    """An owner refused our part (not for want of agreement on the round): it is named in the failure."""

    def __init__(self, owner: str, error: CallFailed):
        super().__init__(str(error), refused=True)
        self.owner = owner


class Unreachable(Exception):
    """No call reached an owner after a few tries: it has most likely died, and the round fails now."""

    def __init__(self, owner: str, error: CallFailed):
        super().__init__(f"{short(owner)} unreachable: {error}")
        self.owner = owner


class WeightsDiverged(RoundFailed):
    """Members of the group hold different weights at the same epoch; a round cannot fix that."""

    def __init__(self, message: str, group: tuple[str, ...]):
        super().__init__(message)
        self.group = group
