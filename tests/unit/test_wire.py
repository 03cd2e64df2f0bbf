"""DHT records parse strictly, and tensors from the network are checked before any compute sees them."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from swarm.wire.records import RecordError, ServerRecord, TrainerRecord
from swarm.wire.validate import (
    BadRequest,
    TensorSpec,
    all_finite,
    check_norm,
    check_same_batch,
    check_tensor,
    largest_magnitude,
)

HIDDEN = TensorSpec(torch.float32, (16, 32))
TOKENS = TensorSpec(torch.int64, (16,), max_value=257)


def server_record(**overrides: Any) -> ServerRecord:
    fields: dict[str, Any] = {
        "peer_id": "QmServer",
        "stage": 1,
        "throughput": 12.5,
        "queue": 2,
        "epoch": 7,
        "pending": 3,
        "config_hash": "abcdef0123456789",
        "model": {"d_model": 32, "n_layers": 2},
    }
    return ServerRecord(**{**fields, **overrides})


def trainer_record(**overrides: Any) -> TrainerRecord:
    fields: dict[str, Any] = {"peer_id": "QmTrainer", "completed": 40, "failed": 1, "loss": 2.5, "done": False}
    return TrainerRecord(**{**fields, **overrides})


# ---- records -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [{}, {"gone": True}, {"capacity": 9.5, "tenure": 31.0, "moving": True, "name": "gpu-a",
                    "optim": {"mode": "async", "lr": 0.01}, "protocol": 2}]
)
def test_server_record_round_trip(extra: dict[str, Any]) -> None:
    """to_value drops the peer id (it is the DHT subkey) and from_value restores an equal record."""
    record = server_record(**extra)
    value = record.to_value()
    assert "peer_id" not in value
    assert ServerRecord.from_value("QmServer", value) == record


def test_trainer_record_round_trip() -> None:
    record = trainer_record(done=True, samples_per_second=42.5)
    value = record.to_value()
    assert "peer_id" not in value
    assert TrainerRecord.from_value("QmTrainer", value) == record


def test_a_trainer_record_from_an_older_peer_has_no_rate() -> None:
    value = trainer_record().to_value()
    del value["samples_per_second"]
    assert TrainerRecord.from_value("QmTrainer", value).samples_per_second == 0.0


def test_server_record_defaults_tombstone_and_widens_int_throughput() -> None:
    """`gone` may be absent (older writers); an int where a float is expected is accepted as a float."""
    value = server_record().to_value()
    del value["gone"]
    value["throughput"] = 3
    parsed = ServerRecord.from_value("QmServer", value)
    assert parsed.gone is False
    assert parsed.throughput == 3.0 and isinstance(parsed.throughput, float)


@pytest.mark.parametrize("field", ["tenure", "calls"])
def test_a_negative_counter_is_refused(field: str) -> None:
    with pytest.raises(RecordError, match="negative"):
        ServerRecord.from_value("QmServer", server_record(**{field: -1}).to_value())


def test_a_server_record_from_an_older_peer_has_no_calls_in_hand() -> None:
    value = server_record(calls=3).to_value()
    assert ServerRecord.from_value("QmServer", value).calls == 3
    del value["calls"]
    assert ServerRecord.from_value("QmServer", value).calls == 0


@pytest.mark.parametrize("value", [None, 5, "stage", [1, 2], (1,)])
@pytest.mark.parametrize("cls", [ServerRecord, TrainerRecord])
def test_non_dict_values_are_refused(cls: type, value: Any) -> None:
    with pytest.raises(RecordError, match="expected a dict"):
        cls.from_value("Qm", value)


@pytest.mark.parametrize("missing", ["stage", "throughput", "queue", "epoch", "pending", "config_hash", "model"])
def test_server_record_missing_field(missing: str) -> None:
    value = server_record().to_value()
    del value[missing]
    with pytest.raises(RecordError, match=f"missing field '{missing}'"):
        ServerRecord.from_value("Qm", value)


@pytest.mark.parametrize("missing", ["completed", "failed", "loss", "done"])
def test_trainer_record_missing_field(missing: str) -> None:
    value = trainer_record().to_value()
    del value[missing]
    with pytest.raises(RecordError, match=f"missing field '{missing}'"):
        TrainerRecord.from_value("Qm", value)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("stage", True),  # bool is an int subclass, but not a stage index
        ("epoch", False),
        ("queue", 1.0),
        ("pending", "3"),
        ("throughput", "fast"),
        ("throughput", None),
        ("config_hash", 123),
        ("model", [1, 2]),
        ("gone", 1),
    ],
)
def test_server_record_wrong_types(field: str, bad: Any) -> None:
    value = server_record().to_value()
    value[field] = bad
    with pytest.raises(RecordError, match=f"field '{field}'"):
        ServerRecord.from_value("Qm", value)


@pytest.mark.parametrize(
    ("field", "bad"),
    [("completed", True), ("failed", 2.0), ("loss", "low"), ("done", 0), ("done", "yes")],
)
def test_trainer_record_wrong_types(field: str, bad: Any) -> None:
    value = trainer_record().to_value()
    value[field] = bad
    with pytest.raises(RecordError, match=f"field '{field}'"):
        TrainerRecord.from_value("Qm", value)


@pytest.mark.parametrize("field", ["stage", "epoch", "pending", "queue"])
def test_server_record_negative_counters(field: str) -> None:
    value = server_record().to_value()
    value[field] = -1
    with pytest.raises(RecordError, match="negative"):
        ServerRecord.from_value("Qm", value)


def test_record_error_is_a_value_error() -> None:
    """Readers drop malformed records with one `except ValueError`-compatible type."""
    assert issubclass(RecordError, ValueError)


# ---- tensors -------------------------------------------------------------------------------------


def test_bad_request_message_carries_the_refusal_marker() -> None:
    """The transport tells a refusal from a failure by this prefix in the error text."""
    assert str(BadRequest("x")).startswith("refused:")
    assert str(BadRequest("wrong shape")) == "refused: wrong shape"
    assert issubclass(BadRequest, ValueError)


def test_good_tensors_are_accepted() -> None:
    check_tensor("hidden", torch.randn(4, 16, 32), HIDDEN, max_batch=4)
    check_tensor("ids", torch.randint(0, 257, (1, 16)), TOKENS, max_batch=4)
    ids = torch.zeros(2, 16, dtype=torch.int64)
    ids[0, 0], ids[1, -1] = 0, 256  # both ends of [0, vocab)
    check_tensor("ids", ids, TOKENS, max_batch=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.bfloat16, torch.int64])
def test_wrong_dtype_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(BadRequest, match="hidden: expected dtype torch.float32"):
        check_tensor("hidden", torch.zeros(2, 16, 32, dtype=dtype), HIDDEN, max_batch=8)


def test_integer_ids_of_another_width_are_refused() -> None:
    with pytest.raises(BadRequest, match="expected dtype torch.int64"):
        check_tensor("ids", torch.zeros(2, 16, dtype=torch.int32), TOKENS, max_batch=8)


@pytest.mark.parametrize("shape", [(2, 16, 31), (2, 15, 32), (2, 16), (2, 16, 32, 1), (16, 32), ()])
def test_wrong_sample_shape_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(BadRequest, match=r"expected shape torch.float32 \[B, 16, 32\]"):
        check_tensor("hidden", torch.zeros(shape), HIDDEN, max_batch=8)


@pytest.mark.parametrize("batch", [0, 9, 100])
def test_batch_outside_limits_is_refused(batch: int) -> None:
    with pytest.raises(BadRequest, match=rf"batch size {batch} outside \[1, 8\]"):
        check_tensor("hidden", torch.zeros(batch, 16, 32), HIDDEN, max_batch=8)


def test_batch_at_the_limit_is_accepted() -> None:
    check_tensor("hidden", torch.zeros(8, 16, 32), HIDDEN, max_batch=8)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(bad: float) -> None:
    x = torch.zeros(2, 16, 32)
    x[1, 5, 7] = bad
    with pytest.raises(BadRequest, match="NaN or Inf"):
        check_tensor("hidden", x, HIDDEN, max_batch=8)


@pytest.mark.parametrize("bad", [-1, 257, 10_000])
def test_token_ids_out_of_vocabulary_are_refused(bad: int) -> None:
    ids = torch.randint(0, 257, (3, 16))
    ids[2, 3] = bad
    with pytest.raises(BadRequest, match=r"ids must lie in \[0, 257\)"):
        check_tensor("ids", ids, TOKENS, max_batch=8)


def test_ids_without_a_vocabulary_bound_are_not_range_checked() -> None:
    spec = TensorSpec(torch.int64, (4,))
    check_tensor("ids", torch.tensor([[-5, 0, 10**9, 3]]), spec, max_batch=1)


def test_same_batch_returns_the_common_size() -> None:
    assert check_same_batch(("inputs", torch.zeros(3, 16)), ("targets", torch.zeros(3, 16, 32))) == 3
    assert check_same_batch(("only", torch.zeros(5, 2))) == 5


def test_different_batches_are_refused_naming_each_tensor() -> None:
    with pytest.raises(BadRequest, match="batch sizes differ") as info:
        check_same_batch(("inputs", torch.zeros(3, 16)), ("grad_outputs", torch.zeros(4, 16)))
    assert "'inputs': 3" in str(info.value) and "'grad_outputs': 4" in str(info.value)


def test_finite_but_huge_values_are_refused_by_the_bounds() -> None:
    """3e38 is finite: the bounds, not the finiteness check, keep it from a stage's weights."""
    huge = torch.zeros(2, 16, 32)
    huge[1, 3, 5] = 3e38
    check_tensor("hidden", huge, HIDDEN, max_batch=2)  # no bound given: finite is enough
    with pytest.raises(BadRequest, match="magnitude 3e\\+38 exceeds the bound of 1e\\+06"):
        check_tensor("hidden", huge, HIDDEN, max_batch=2, max_abs=1e6)
    with pytest.raises(BadRequest, match="grad_outputs: norm 3e\\+38 exceeds the bound of 1e\\+03"):
        check_norm("grad_outputs", huge, 1e3)
    check_norm("grad_outputs", torch.full((2, 16, 32), 1.0), 1e3)  # norm 32
    check_norm("grad_outputs", huge, 0.0)  # 0: no bound


def test_a_half_precision_gradient_is_normed_in_float32_where_its_squares_fit() -> None:
    """60000 is within float16, its square is not: a norm in the tensor's own dtype would be infinite."""
    big = torch.full((4, 32, 32), 60000.0, dtype=torch.float16)  # norm 60000 * 64 = 3.84e6
    check_norm("grad_outputs", big, 4e6)
    with pytest.raises(BadRequest, match="norm 3.84e\\+06 exceeds the bound of 3e\\+06"):
        check_norm("grad_outputs", big, 3e6)


def test_a_record_whose_subkey_is_no_peer_id_is_dropped_and_the_rest_read() -> None:
    """A forged subkey once crashed whoever tried to call it; now the read leaves it out, and also a
    record set to live far longer than a server record does."""
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.utils import get_dht_time

    from swarm.net.directory import _by_peer, _parse
    from swarm.net.identity import peer_id_of

    good, late = (peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(2))
    value, soon = server_record().to_value(), get_dht_time() + 5
    found = SimpleNamespace(value={
        good: SimpleNamespace(value=value, expiration_time=soon),
        "not a peer": SimpleNamespace(value=value, expiration_time=soon),
        "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco": SimpleNamespace(value=value, expiration_time=soon),
        late: SimpleNamespace(value=value, expiration_time=soon + 10**6),
    })
    records = _parse(found, _by_peer(ServerRecord.from_value), max_lifetime=60)
    assert [r.peer_id for r in records] == [good]


def test_a_stage_read_keeps_when_each_servers_newest_record_expires_and_forgets_long_expired_ones() -> None:
    """A trainer takes a server for gone once a read begun after its newest record expired misses it
    (swarm.trainer.view): the expiry kept is the latest read, never an older copy's, and an expiry long
    past is forgotten, so churn does not grow the table without bound."""
    from types import SimpleNamespace

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.utils import get_dht_time

    from swarm.net.directory import FORGET_EXPIRED, Directory
    from swarm.net.identity import peer_id_of

    record = server_record()
    peer, gone = (peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(2))
    now = get_dht_time()

    class DHT:
        entries: dict = {}

        async def get(self, key, latest, return_future):
            return SimpleNamespace(value={p: SimpleNamespace(value=record.to_value(), expiration_time=t)
                                          for p, t in self.entries.items()})

    directory = Directory(DHT(), "run", record_ttl=6.0)
    directory.expires[gone] = now - FORGET_EXPIRED - 1
    DHT.entries = {peer: now + 6}
    asyncio.run(directory.stage(record.stage))
    assert directory.expires == {peer: now + 6}
    DHT.entries = {peer: now + 3}  # an older copy, from a node the renewal has not reached
    asyncio.run(directory.stage(record.stage))
    assert directory.expires == {peer: now + 6}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_anywhere_in_a_large_tensor_is_found(bad: float) -> None:
    """The extremes a tensor is read from carry a NaN or an infinity from any position."""
    for at in (0, 123_457, 999_999):
        x = torch.randn(1_000_000)
        assert all_finite(x)
        x[at] = bad
        assert not all_finite(x)
        assert not math.isfinite(largest_magnitude(x))


def test_the_largest_magnitude_is_read_from_either_extreme() -> None:
    assert largest_magnitude(torch.tensor([1.0, -3.0, 2.0])) == 3.0
    assert largest_magnitude(torch.tensor([1.0, -3.0, 5.0])) == 5.0
    assert largest_magnitude(torch.zeros(0)) == 0.0
