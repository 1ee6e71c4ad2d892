"""Weight transfer between real processes over gloo on 127.0.0.1 (each test bounded in time)."""

from functools import partial

import pytest
import sync_workers as w
from sync_processes import run_group

NAMES = list(w.mixed_tensors())


def ok(outcome, rank):
    status, value = outcome[rank]
    assert status == "ok", f"rank {rank}: {status}: {value}"
    return value


@pytest.mark.parametrize("verify", [False, True])
def test_two_processes_mixed_dtypes_shapes_and_a_split_tensor(verify):
    out = run_group([partial(w.send_mixed, verify=verify), w.receive_all])
    sent = ok(out, 0)
    assert sent["tensors"] == len(NAMES)
    assert sent["buckets"] > 10  # "big" alone spans ~10 buckets of 16 kB
    got = ok(out, 1)
    assert got == {"version": 7, "names": NAMES, "equal": True}


def test_three_processes_one_sender_two_receivers():
    out = run_group([w.send_mixed, w.receive_all, w.load_module])
    assert ok(out, 1)["equal"]
    assert ok(out, 2) == {"version": 7, "equal": True}


def test_lazy_iterator_with_manifest_into_a_module():
    out = run_group([w.send_mixed_lazily, w.load_module])
    assert ok(out, 0) == len(NAMES)
    assert ok(out, 1) == {"version": 1, "equal": True}


def test_versions_and_empty_transfer():
    out = run_group([w.send_versions, w.receive_versions])
    assert ok(out, 0) == [1, 2, 5]
    assert ok(out, 1) == [(1, 1.0), (2, 2.0), (5, 5.0)]
    out = run_group([w.send_empty, w.receive_count])
    assert ok(out, 0) == 1
    assert ok(out, 1) == {"tensors": 0, "version": 4}


def test_large_tensors_land_in_buffers_reused_from_transfer_to_transfer():
    """`receive()`: a large tensor (sent direct, or split over buckets) lands in a buffer the consumer's advance has
    freed, not in fresh memory that pays its page faults on every transfer; the values are right either way."""
    out = run_group([w.send_mixed_twice, w.receive_twice_noting_buffers])
    assert ok(out, 0) == [1, 2]
    got = ok(out, 1)
    assert got["equal"]
    assert "big" in got["large"]
    assert got["reused"]


def test_the_garbage_collector_waits_for_the_transfer_on_both_sides():
    """A transfer allocates many small objects per tensor; the automatic collections they would start (each full one
    walks every object of a trainer) wait until it is over, and the collector runs again after."""
    out = run_group([w.send_noting_the_collector, w.load_noting_the_collector])
    assert ok(out, 0) == {"during": {False}, "after": True}
    assert ok(out, 1) == {"during": {False}, "after": True}


def test_load_weights_target_gets_copies_it_may_keep():
    out = run_group([w.send_mixed, w.load_weights_target])
    assert ok(out, 1) == {"version": 7, "equal": True}


def test_shape_mismatch_applies_nothing_and_the_sender_learns_it():
    out = run_group([w.send_mixed, w.load_mismatched_module], deadline=15)  # no waiting on timeouts
    status, error = out[0]
    assert status == "error"
    assert "TransferError" in error
    assert "failed to apply version 7" in error
    got = ok(out, 1)
    assert "layer.0.weight" in got["error"]
    assert "nothing applied" in got["error"]
    assert got["untouched"]


@pytest.mark.parametrize("strict", [True, False])
def test_missing_names_raise_only_when_strict(strict):
    out = run_group([w.send_mixed, partial(w.load_into_holder_missing_one, strict=strict)])
    got = ok(out, 1)
    if strict:
        assert got.startswith("ValueError")
        assert "missing 'extra'" in got
    else:
        assert got == 7


def test_receiver_killed_mid_transfer_makes_the_sender_raise_within_the_timeout(tmp_path):
    marker = tmp_path / "under-way"
    out = run_group([w.send_large, partial(w.load_slowly, marker=str(marker))], kill={1: marker.exists}, deadline=60)
    status, error = out[0]
    assert status == "error", out
    assert "TransferError" in error


def test_sender_killed_mid_transfer_says_what_was_applied_and_reports_no_version(tmp_path):
    marker = tmp_path / "under-way"
    out = run_group(
        [partial(w.send_slowly, marker=str(marker)), w.load_module_with_timeout], kill={0: marker.exists}, deadline=60
    )
    got = ok(out, 1)
    assert got["error"] == "PartialLoadError"
    assert got["version"] is None
    assert 0 < len(got["applied"]) < 40
    assert got["applied"] == [f"t{i}" for i in range(len(got["applied"]))]
    assert got["seconds"] < 4 + 5 + 3  # the transfer until the kill, then at most the timeout (plus slack)


def test_stalled_receiver_makes_the_sender_raise_within_the_timeout():
    out = run_group([partial(w.send_large, timeout=3.0), w.stall], deadline=60)
    status, error = out[0]
    assert status == "error"
    assert "stalled longer than 3 s" in error or "peer gone" in error


def test_failing_input_aborts_the_transfer_on_every_side():
    out = run_group([w.send_failing_input, w.expect_error], deadline=15)
    assert out[0][0] == "error"
    assert "merge exploded" in out[0][1]
    got = ok(out, 1)
    assert got["error"] == "TransferError"
    assert "sender aborted: RuntimeError: merge exploded" in got["message"]
    assert got["version"] is None


def test_checksums_catch_a_corrupted_bucket():
    out = run_group([w.send_corrupted, w.expect_error], deadline=15)
    got = ok(out, 1)
    assert got["error"] == "TransferError"
    assert "bucket 1 is corrupted" in got["message"]
    assert out[0][0] == "error"  # and the sender learns that the receiver failed


def test_a_bucket_that_contradicts_the_manifest_is_refused_before_its_bytes_land():
    out = run_group([w.send_lying_manifest, w.load_lied_to], deadline=30)
    got = ok(out, 1)
    assert got["error"] == "PartialLoadError"
    assert "'big'" in got["message"]
    assert "is not in the manifest as sent" in got["message"]
    assert got["big_untouched"]
    assert out[0][0] == "error"  # and the sender learns that the receiver failed


def test_protocol_version_mismatch_is_refused():
    out = run_group([w.send_other_protocol, w.expect_error])
    got = ok(out, 1)
    assert got["error"] == "ProtocolError"
    assert "protocol 99" in got["message"]


def test_adapter_transfer():
    out = run_group([w.send_adapter, w.receive_adapter])
    assert ok(out, 0) == 9
    got = ok(out, 1)
    assert got["version"] == 9
    assert got["config"]["r"] == 4
    assert got["names"] == ["base_model.model.q_proj.lora_A.weight", "base_model.model.q_proj.lora_B.weight"]
