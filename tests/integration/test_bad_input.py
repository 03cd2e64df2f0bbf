"""Malformed requests get a clear error back, and the server keeps serving."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID

from swarm.config import config_hash
from swarm.net.directory import Directory
from swarm.net.node import start_dht
from swarm.net.protocol import Tagged
from swarm.net.transport import CallFailed, StageClient
from swarm.ops.local import LocalSwarm
from swarm.wire.codecs import Packed

from .helpers import small_config, tracebacks, wait_for_stages

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_bad_requests_are_refused_and_serving_goes_on(tmp_path):
    cfg = small_config(tmp_path, "net.max_payload_mb=0.1", "server.max_request_samples=8")
    seq, d, good_hash = cfg.model.seq_len, cfg.model.d_model, config_hash(cfg)
    swarm = LocalSwarm(cfg)
    swarm.start_bootstrap()
    for stage in range(cfg.model.num_stages):
        swarm.add_server(stage)

    ids = torch.randint(0, 256, (2, seq))
    hidden = torch.randn(2, seq, d)
    nan_hidden = hidden.clone()
    nan_hidden[0, 0, 0] = float("nan")
    inf_hidden = hidden.clone()
    inf_hidden[1, 2, 3] = float("inf")
    huge = hidden.clone()
    huge[0, 1, 2] = 3e38  # finite: only the bounds stop it
    # one value per block of 2^29: decoded by padding to whole blocks, it held a server for 21 s
    big_block = Packed({"codec": "blockwise8", "shape": list(hidden.shape), "dtype": "float32", "block": 1 << 29},
                       [torch.zeros(hidden.numel(), dtype=torch.int8), torch.ones(1)])
    cases = [  # (stage, method, meta overrides, tensors, expected words in the error)
        (0, "forward", {}, [ids.float()], "dtype"),
        (0, "forward", {}, [torch.randint(0, 256, (2, seq + 1))], "shape"),
        (0, "forward", {}, [torch.full((2, seq), 300)], "ids must lie"),
        (0, "forward", {}, [torch.randint(0, 256, (9, seq))], "batch size"),
        (0, "forward", {}, [ids, ids], "one tensor"),
        (0, "forward", {"config": "0123456789abcdef"}, [ids], "config hash"),
        (0, "forward", {"req": ""}, [ids], "request id"),
        (0, "backward", {}, [ids, torch.randn(3, seq, d)], "batch sizes differ"),
        (1, "forward", {}, [nan_hidden, ids], "NaN or Inf"),
        (1, "forward", {}, [inf_hidden, ids], "NaN or Inf"),
        (1, "forward", {}, [hidden], "inputs, targets"),
        (1, "forward", {}, [torch.randn(8, seq, d), torch.randint(0, 256, (8, seq))], "exceeds the limit"),
        (1, "backward", {}, [hidden, hidden], "last stage"),
        (1, "forward", {}, [huge, ids], "exceeds the bound"),
        (0, "backward", {}, [ids, huge], "grad_outputs: norm"),
        (1, "forward", {}, [Tagged("activations", big_block), ids], "block size"),
    ]

    async def scenario() -> list[str]:
        peers_override = f"net.initial_peers={list(swarm.initial_peers)!r}".replace("'", '"')
        dht = start_dht(small_config(tmp_path, peers_override).net, client_mode=True)
        try:
            client = StageClient(await dht.replicate_p2p())
            peers = await wait_for_stages(Directory(dht, cfg.net.run_id, cfg.net.record_ttl), 2, 90)
            errors = []
            for n, (stage, method, meta_over, tensors, expected) in enumerate(cases):
                meta = {"req": f"bad{n}", "stage": stage, "config": good_hash, **meta_over}
                with pytest.raises(CallFailed) as info:
                    await client.call(peers[stage], method, meta, tensors, 30)
                assert info.value.refused, (n, str(info.value))
                assert expected in str(info.value), (n, str(info.value))
                errors.append(str(info.value))
                # the same server answers the next good request
                # (for the input gradient only: accumulating needs a trainer's receipt, see swarm.net.receipts)
                good = {"req": f"good{n}", "stage": stage, "config": good_hash, "accumulate": False}
                if stage == 0:
                    reply, (out,) = await client.call(peers[0], "forward", good, [ids], 30)
                    assert out.shape == (2, seq, d) and torch.isfinite(out).all()
                else:
                    reply, (grad,) = await client.call(peers[1], "forward", good, [hidden, ids], 30)
                    assert reply["loss"] > 0 and grad.shape == hidden.shape
            await _send_an_oversized_message(client.p2p, peers[1])
            after = {"req": "after", "stage": 1, "config": good_hash, "accumulate": False}
            reply, _ = await client.call(peers[1], "forward", after, [hidden, ids], 30)
            assert reply["loss"] > 0
            # a request for another stage comes from a caller whose view lags a server's move: it is
            # answered "unavailable" (the caller goes elsewhere), not refused as malformed
            with pytest.raises(CallFailed) as info:
                await client.call(peers[0], "forward", {"req": "moved", "stage": 1, "config": good_hash}, [ids], 30)
            assert info.value.answered and not info.value.refused
            assert "hosts stage 0" in str(info.value)
            return errors
        finally:
            dht.shutdown()

    try:
        errors = asyncio.run(scenario())
    finally:
        swarm.stop()
    assert len(errors) == len(cases)
    assert not tracebacks(tmp_path)
    logged = sum(log.read_text().count(" refused: ") for log in (tmp_path / "logs").glob("server-*.log"))
    # one line per refused request; a payload over the limit is refused before all of it has arrived, so
    # its caller may see the stream break instead of the answer, and the transport sends it once more
    oversize = sum(expected == "exceeds the limit" for *_, expected in cases)
    assert len(cases) <= logged <= len(cases) + oversize
    (stage_1_log,) = (tmp_path / "logs").glob("server-s1-*.log")
    assert "stream message of 1099511627776 bytes cut off" in stage_1_log.read_text()


async def _send_an_oversized_message(p2p, peer: str) -> None:
    """A stream message whose header declares 1 TiB: hivemind would try to read it all. The server ends
    the stream at the header, at once."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), "StageServicer.rpc_forward")
    writer.write(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"x" * 1024)
    await writer.drain()
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
    assert time.monotonic() - started < 5
    writer.close()


REFUSED = {  # a setting that differs from the swarm's, and how the refusal names it
    "model.d_model=32": "model.d_model: 32 here, 64 there",
    'optim.mode="async"': "optim.mode: 'async' here, 'sync' there",
    "optim.lr=0.01": "optim.lr: 0.01 here, 0.003 there",
    "optim.target_batch_size=32": "optim.target_batch_size: 32 here, 16 there",
}


@pytest.mark.timeout(180)
def test_servers_with_other_agreed_settings_are_refused(tmp_path):
    cfg = small_config(tmp_path)
    swarm = LocalSwarm(cfg)
    swarm.start_bootstrap()
    first = swarm.add_server(0)
    try:
        swarm._wait(lambda: "up on" in first.log_path.read_text(), 90, "the first server", first)
        odd = {setting: swarm.add_server(1, (setting,)) for setting in REFUSED}
        for setting, peer in odd.items():
            assert peer.process.wait(timeout=120) == 3, setting
            text = peer.log_path.read_text()
            assert "refused to join" in text and REFUSED[setting] in text, text
        assert first.alive()
    finally:
        swarm.stop()
