"""A replica's delivery ledger: which microbatches its accumulated gradient holds (`pending`, with their
samples) and which ones the stage's recent steps took in (`committed`: id -> the epoch the step
produced, kept for `keep_epochs` epochs and handed to newcomers with the state). A microbatch already
held or committed is never accumulated again: a repeated or replayed call only gets its input gradient
back. The trainers' side of exactly-once (`swarm.core.delivery`) asks replicas what their ledgers say.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

MAX_RECEIPTS = 1 << 16  # receipts kept for gradients not yet held (a request dropped before it ran leaves one)


class Ledger:
    def __init__(self, keep_epochs: int):
        self.keep_epochs = keep_epochs
        self.pending: dict[str, int] = {}  # microbatch id -> samples, accumulated since the last step
        self.pending_samples = 0  # their sum, readable from the network thread without iterating
        self.committed: dict[str, int] = {}  # microbatch id -> the epoch its step produced (recent steps)
        # microbatch id -> the trainer's receipt, shown to groupmates (see swarm.net.receipts)
        self.receipts: dict[str, str] = {}

    def accumulates(self, req_id: str) -> bool:
        """Whether a gradient for `req_id` would be new to the stage (else it is a duplicate)."""
        return req_id not in self.pending and req_id not in self.committed

    def note_receipt(self, req_id: str, receipt: str) -> None:
        """Keep a gradient's receipt, taken before it is accumulated."""
        self.receipts[req_id] = receipt
        while len(self.receipts) > MAX_RECEIPTS:
            del self.receipts[next(iter(self.receipts))]

    def receipts_for(self, ids: Iterable[str]) -> list[list]:
        """[samples, receipt] of each held id, as a round lists them ("" where no receipt was kept)."""
        return [[self.pending.get(req_id, 0), self.receipts.get(req_id, "")] for req_id in ids]

    def hold(self, req_id: str, samples: int) -> None:
        self.pending[req_id] = samples
        self.pending_samples += samples

    def commit(self, ids: Iterable[str], epoch: int) -> None:
        """Record a step's microbatches, forgetting steps older than `keep_epochs` before it. A receipt is
        kept while its microbatch is still held: a replay that reached this replica while the round ran
        (another replica's part brought the same microbatch into the step) goes into the next step, and
        without its receipt every later round would refuse this replica's part."""
        for req_id in ids:
            self.committed[req_id] = epoch
            if req_id not in self.pending:
                self.receipts.pop(req_id, None)
        oldest = epoch - self.keep_epochs
        while self.committed:  # insertion order is epoch order: forget from the front
            first = next(iter(self.committed))
            if self.committed[first] > oldest:
                break
            del self.committed[first]

    def unpend(self, ids: Iterable[str]) -> None:
        """These microbatches left the accumulated gradient (a round took them in)."""
        for req_id in ids:
            self.pending_samples -= self.pending.pop(req_id, 0)
            self.receipts.pop(req_id, None)

    def clear_pending(self) -> int:
        """Forget everything held (stepped, or dropped); the samples it held."""
        held = self.pending_samples
        for req_id in self.pending:
            self.receipts.pop(req_id, None)
        self.pending, self.pending_samples = {}, 0
        return held

    def steps(self) -> dict[int, list[str]]:
        """The microbatches of each remembered step, by the epoch it produced."""
        steps: dict[int, list[str]] = {}
        for req_id, epoch in self.committed.items():
            steps.setdefault(epoch, []).append(req_id)
        return {epoch: sorted(ids) for epoch, ids in sorted(steps.items())}

    def restore(self, steps: Iterable[tuple[int, list[str]]]) -> None:
        """Take another replica's remembered steps (with its state) in place of ours."""
        self.committed = {}
        for epoch, ids in steps:
            self.commit(ids, int(epoch))


def carry(pending: Collection[str], aside: list[list[str]], epoch: int, loaded_epoch: int,
          loaded_steps: Iterable[tuple[int, list[str]]]) -> list[bool] | None:
    """What a replica at `epoch`, holding `pending` (of which `aside` lists the parts its failed rounds
    took out), keeps on loading the state of `loaded_epoch` with that state's remembered steps: None to
    drop everything, else whether each set-aside part is kept (the rest of what it holds is).

    Its gradients were computed at the weights of `epoch`. Loaded one step ahead, they are one step old,
    as the gradients that come in while a round runs are on a replica whose round succeeds, and as those
    of a graph a step overtook: they count in the next step. What the loaded step took in must not count
    twice: a failed round's part the step took in whole (its owner got it and stepped) is dropped alone.
    A held microbatch the step took in otherwise (a replay accumulated elsewhere too), or a part it took in
    only in part, cannot be told apart from the rest of the sum: then all is dropped, as it is when the
    replica is further behind, and trainers accumulate again whatever no replica holds."""
    if loaded_epoch != epoch + 1:
        return None
    stepped = {req_id for step_epoch, ids in loaded_steps if step_epoch == loaded_epoch for req_id in ids}
    parts = [set(ids) for ids in aside]
    in_parts = set().union(*parts)
    if any(req_id in stepped for req_id in pending if req_id not in in_parts):
        return None
    if any(part & stepped and not part <= stepped for part in parts):
        return None
    return [not part & stepped for part in parts]


def merge_ids(lists: list[list[str]]) -> tuple[list[str], list[str]]:
    """The union of members' microbatch lists, and the ids found in more than one of them."""
    seen: set[str] = set()
    twice: set[str] = set()
    for ids in lists:
        for req_id in ids:
            (twice if req_id in seen else seen).add(req_id)
    return sorted(seen), sorted(twice)
