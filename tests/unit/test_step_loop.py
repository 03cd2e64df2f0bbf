"""The step loop stops when cancelled, also when the cancellation comes as a gradient wakes it: a server
leaving its stage cancels the loop, and one that ran on would hold the server in its stage for good."""

from __future__ import annotations

import asyncio

import pytest
from tests.unit.test_server_parts import CFG, served

from swarm.server.gate import ComputeGate
from swarm.server.stepping import Stepper


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_a_step_loop_cancelled_as_it_is_woken_stops(turns: int) -> None:
    async def scenario() -> None:
        _, st = served(1, ComputeGate(1.0, False))
        stepper = Stepper(st, "QmMe", CFG.optim, CFG.net, 0, None, None, None, None, None, None, "", None)
        looks = 0

        async def look() -> None:
            nonlocal looks
            looks += 1

        stepper._look_and_act = look
        loop = asyncio.create_task(stepper.loop())
        await asyncio.sleep(0.01)
        st.wake.set()  # a gradient came in
        for _ in range(turns):  # the loop's wait sees it after this many turns of the event loop
            await asyncio.sleep(0)
        loop.cancel()
        done, _ = await asyncio.wait([loop], timeout=2.0)
        assert done, f"the step loop ran on after it was cancelled ({looks} looks)"
        assert loop.cancelled()

    asyncio.run(scenario())
