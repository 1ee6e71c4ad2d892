"""The bucket packer on its own: every byte lands in exactly one entry, small tensors packed (split where a bucket
fills up), large ones direct in chunks of at most a bucket, order kept."""

import torch
from sync_workers import SMALL_BUCKET, mixed_tensors

from lorarl.weight_sync.protocol import ALIGN, TensorSpec
from lorarl.weight_sync.sender import _Packer


def test_packing_covers_every_byte_in_order_within_bucket_limits():
    tensors = mixed_tensors()
    rebuilt: dict[str, bytearray] = {}
    order, kinds = [], {"packed split": 0, "direct chunked": 0}
    buckets = list(_Packer(SMALL_BUCKET, SMALL_BUCKET // 8, None).buckets(tensors.items()))
    assert [b.index for b, _, _ in buckets] == list(range(len(buckets)))
    assert [b.last for b, _, _ in buckets] == [False] * (len(buckets) - 1) + [True]
    for bucket, packed, direct in buckets:
        assert bucket.payload_bytes + sum(e.length for e in bucket.direct) <= SMALL_BUCKET
        parts = {
            id(e): p for e, p in [*zip(bucket.packed, packed, strict=True), *zip(bucket.direct, direct, strict=True)]
        }
        for entry in bucket.entries:  # in the order sent
            part = parts[id(entry)]
            assert entry.length == part.numel() <= SMALL_BUCKET
            assert entry.offset % ALIGN == 0
            data = rebuilt.setdefault(entry.spec.name, bytearray())
            assert len(data) == entry.start  # parts come in order, nothing skipped
            data += bytes(part.numpy().tobytes())
            if entry.start == 0:
                order.append(entry.spec.name)
        kinds["packed split"] += sum(not e.whole for e in bucket.packed)
        kinds["direct chunked"] += sum(not e.whole for e in bucket.direct)
    assert order == list(tensors)
    assert kinds["packed split"] > 0
    assert kinds["direct chunked"] > 0
    for name, tensor in tensors.items():
        spec = TensorSpec.of(name, tensor)
        assert len(rebuilt[name]) == spec.nbytes
        assert bytes(rebuilt[name]) == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
