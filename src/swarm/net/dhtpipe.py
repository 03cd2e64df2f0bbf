"""A peer's calls to its DHT process, answered over a pipe that process inherits when it is forked.

hivemind hands each call a `MPFuture` to answer through. Pickling one sends the peer's end of a pipe
along with it, which `multiprocessing` does by lending the descriptor: the DHT process connects back to
a listener thread of the peer's, passes an HMAC challenge both ways, receives a copy of the descriptor,
and builds a connection for that one answer; the future's state sits in shared memory that the DHT
process maps anew. In a local swarm's profile that was a fifth of the CPU time of the servers' threads
outside their compute, and of their DHT processes, for a few calls a second.

Here a call carries a number instead (`Reply`), and the answer comes back as (number, outcome) over one
pipe made before the fork. Calls made from any other process than the one that started the DHT (which
has no reader on that pipe) take hivemind's own way.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import pickle
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any


class DHTCall(Future):
    """An answer to come from the DHT process: `result()` waits for it, `await` does so in a loop."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class DHTGone(ConnectionError):
    """The DHT process ended with this call unanswered."""


_answers: Any = None  # in the DHT process: the pipe's sending end (see `CallPipe.serve`)
_send_lock = threading.Lock()


@dataclass
class Reply:
    """What the DHT process answers a call through, in place of hivemind's future (the same methods)."""

    number: int
    answered: bool = False

    def done(self) -> bool:
        return self.answered

    def set_result(self, value: Any) -> None:
        self._send(True, value)

    def set_exception(self, error: BaseException) -> None:
        self._send(False, error)

    def _send(self, ok: bool, payload: Any) -> None:
        if self.answered:
            return
        self.answered = True
        try:
            message = pickle.dumps((self.number, ok, payload))
        except Exception as e:  # an answer that cannot travel still ends the call
            message = pickle.dumps((self.number, False, RuntimeError(f"unpicklable DHT answer: {e!r}")))
        with _send_lock:
            _answers.send_bytes(message)


class CallPipe:
    """Made before the DHT process is started; `serve` runs in that process, `open` and the reader in the
    peer's."""

    def __init__(self) -> None:
        self._receiving, self._sending = mp.Pipe(duplex=False)
        self.owner = os.getpid()
        self._pending: dict[int, DHTCall] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._gone = False  # the DHT process ended: the reader has failed what was pending

    def serve(self) -> None:
        """In the DHT process, before it takes calls: answers go out through the inherited end."""
        global _answers
        _answers = self._sending
        self._receiving.close()

    @property
    def reading(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def started(self) -> None:
        """In the peer, once the DHT process is forked: only it holds the sending end now, so that the
        reader sees the pipe close when that process ends."""
        self._sending.close()
        self._reader = threading.Thread(target=self._read, name="dht-answers", daemon=True)
        self._reader.start()

    def open(self) -> tuple[DHTCall, Reply]:
        """A new call: the future the caller waits on, and what travels to the DHT process with it. Once the
        DHT process is gone, the call fails at once (no answer could come for it)."""
        call = DHTCall()
        with self._lock:
            number = next(self._numbers)
            if not self._gone:
                self._pending[number] = call
        if self._gone:
            _settle(call, False, DHTGone("the DHT process had ended"))
        return call, Reply(number)

    def _read(self) -> None:
        while True:
            try:
                number, ok, payload = pickle.loads(self._receiving.recv_bytes())
            except (EOFError, OSError):
                break
            with self._lock:
                call = self._pending.pop(number, None)
            if call is not None:
                _settle(call, ok, payload)
        self._receiving.close()  # (a process may start many DHTs in its life: tests do)
        with self._lock:
            unanswered, self._pending, self._gone = list(self._pending.values()), {}, True
        for call in unanswered:
            _settle(call, False, DHTGone("the DHT process ended before answering"))


def _settle(call: DHTCall, ok: bool, payload: Any) -> None:
    try:
        if ok:
            call.set_result(payload)
        else:
            call.set_exception(payload)
    except InvalidStateError:  # the caller gave up on it (cancelled) meanwhile
        pass
