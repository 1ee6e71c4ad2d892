"""Shared buckets between real processes (shared memory on CPU stands in for CUDA IPC: the same code path)."""

from functools import partial

import pytest
import shared_workers as s
import torch
from sync_processes import run_group
from sync_workers import mixed_tensors

from lorarl.weight_sync import ProtocolError, TensorSpec
from lorarl.weight_sync.shared import SharedBucket, open_bucket, share_buckets


def ok(outcome, rank):
    status, value = outcome[rank]
    assert status == "ok", value
    return value


def test_two_consumers_take_two_transfers_tensor_by_tensor_from_reused_buckets():
    out = run_group([s.producer, s.consumer, s.consumer], join=False, deadline=120)
    posted = ok(out, 0)
    assert all(buckets > 5 for _, _, buckets in posted)  # small buckets: the packed buffer was reused many times
    for rank in (1, 2):
        s.check_two_transfers(ok(out, rank))
    expected = mixed_tensors(0)
    assert posted[0][:2] == (len(expected), sum(t.numel() * t.element_size() for t in expected.values()))


def test_an_input_that_raises_stops_every_consumer():
    out = run_group([s.failing_producer, s.expect_error, s.expect_error], join=False, deadline=60)
    assert ok(out, 0) == "the merge failed"
    for rank in (1, 2):
        assert ok(out, rank).startswith("TransferError: the producer aborted the transfer: RuntimeError")


def test_a_consumer_that_dies_or_stops_makes_the_producer_raise_not_hang():
    # a hung producer is killed at the deadline and reported "hung"; the deadline is wide, as starting three
    # processes on a busy machine can take longer than the producer's own 3 s
    out = run_group([partial(s.producer, timeout=3), s.dying_consumer, s.consumer], join=False, deadline=60)
    assert out[0][0] == "error", out[0]
    assert "a consumer did not finish within 3 s" in out[0][1]
    assert out[2][0] == "error"  # the other consumer learns it too
    assert "TransferError" in out[2][1]
    out = run_group([s.producer, s.stopping_consumer, s.consumer], join=False, deadline=60)
    assert out[0][0] == "error"
    assert "consumer 1 stopped" in out[0][1]
    assert ok(out, 1) == "stopped"


def test_buckets_respect_their_size_and_a_larger_tensor_is_a_bucket_of_its_own():
    tensors = {"a": torch.zeros(1000), "big": torch.zeros(10_000), "b": torch.zeros(100), "c": torch.zeros(900)}
    buckets = list(share_buckets(tensors, version=1, device="cpu", bucket_bytes=8192))  # direct from 8192 bytes
    assert [[spec.name for spec, _ in b.packed] + [spec.name for spec, _ in b.direct] for b in buckets] == [
        ["a"],
        ["big"],
        ["b", "c"],
    ]
    assert [b.last for b in buckets] == [False, False, True]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert sum(b.nbytes for b in buckets) == 4 * (1000 + 10_000 + 100 + 900)


def test_empty_input_is_one_last_empty_bucket():
    (bucket,) = share_buckets({}, version=4, device="cpu")
    assert bucket == SharedBucket(4, 0, True, None, [], [])
    assert open_bucket(bucket) == []


def test_bad_input_raises_naming_the_problem():
    with pytest.raises(ValueError, match="manifest"):
        list(share_buckets({"a": torch.zeros(3)}, version=1, device="cpu", manifest=[("a", (4,), torch.float32)]))
    two = [("a", (3,), torch.float32), ("b", (3,), torch.float32)]
    with pytest.raises(ValueError, match="manifest lists 2"):
        list(share_buckets({"a": torch.zeros(3)}, version=1, device="cpu", manifest=two))
    with pytest.raises(TypeError, match=r"\(str, Tensor\)"):
        list(share_buckets([("a", [1.0])], version=1, device="cpu"))
    with pytest.raises(ValueError, match="is on meta"):
        list(share_buckets({"a": torch.zeros(3, device="meta")}, version=1, device="cpu"))
    with pytest.raises(TypeError, match="SharedBucket"):
        open_bucket(("not", "a", "bucket"))
    buckets = share_buckets({"a": torch.zeros(3)}, version=1, device="cpu", bucket_bytes=4096, direct_bytes=1024)
    bucket = next(buckets)  # the buffer lives while the producer's iterator does
    lying = bucket._replace(packed=[(TensorSpec("a", "float32", (3000,)), 0)])
    with pytest.raises(ProtocolError, match="outside the shared payload"):
        open_bucket(lying)
