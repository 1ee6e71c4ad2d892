"""What each process of a weight-sync test does (module-level functions: they are started with spawn)."""

import gc
import time

import torch
from torch import nn

from lorarl.weight_sync import BucketReceiver, BucketSender, TensorSpec
from lorarl.weight_sync.protocol import CONTROL_BYTES, TransferHeader

SMALL_BUCKET = 16 << 10


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Many shapes and dtypes, one tensor larger than a small bucket, an empty one, a scalar."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 48, generator=g).bfloat16(),
        "layer.0.weight": torch.randn(48, 48, generator=g),
        "layer.0.bias": torch.randn(48, generator=g).half(),
        "big": torch.randn(40_000, generator=g),  # 160 kB: split over ~10 buckets
        "positions": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(17, 3, generator=g) > 0.5,
        "codes": torch.randint(-128, 127, (333,), generator=g, dtype=torch.int8),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(3.5),
        "transposed": torch.randn(20, 30, generator=g).t(),  # not contiguous
        **{f"small.{i}": torch.randn(375, generator=g) for i in range(30)},  # 1.5 kB each: packed, some split
    }


class Holder(nn.Module):
    """A module whose state dict has exactly the given names, shapes and dtypes (zeros)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for i, t in enumerate(tensors.values()):
            self.register_buffer(f"b{i}", torch.zeros(t.shape, dtype=t.dtype))
        self.names = list(tensors)

    def state_dict(self, *args, **kwargs):
        own = super().state_dict(*args, **kwargs)
        return dict(zip(self.names, own.values(), strict=True))


# --- senders -------------------------------------------------------------------------------------------------------


def send_mixed(group, rank, version=7, verify=True, bucket=SMALL_BUCKET):
    stats = BucketSender(group, bucket_bytes=bucket, verify=verify, direct_bytes=bucket // 8).send(
        mixed_tensors(), version=version
    )
    return {"version": stats.version, "tensors": stats.tensors, "buckets": stats.buckets, "bytes": stats.bytes}


def send_mixed_lazily(group, rank):
    tensors = mixed_tensors()
    manifest = [TensorSpec.of(n, t) for n, t in tensors.items()]
    stats = BucketSender(group, bucket_bytes=SMALL_BUCKET).send(iter(tensors.items()), version=1, manifest=manifest)
    return stats.tensors


def send_versions(group, rank):
    sender = BucketSender(group, bucket_bytes=SMALL_BUCKET)
    return [sender.send({"w": torch.full((10,), float(v))}, version=v).version for v in (1, 2, 5)]


def send_mixed_twice(group, rank):
    """Two versions of the mixed tensors (other values), in small buckets: large tensors go direct or split."""
    sender = BucketSender(group, bucket_bytes=SMALL_BUCKET, direct_bytes=SMALL_BUCKET // 8)
    return [sender.send(mixed_tensors(seed), version=seed).version for seed in (1, 2)]


def receive_twice_noting_buffers(group, rank):
    """Each transfer's values (copied, as a consumer must) and where its large tensors landed."""
    receiver = BucketReceiver(group)
    equal, landed = [], []
    for seed in (1, 2):
        want, where = mixed_tensors(seed), {}
        for name, tensor in receiver.receive():
            equal.append(torch.equal(tensor.clone(), want[name]))
            if tensor.nbytes > SMALL_BUCKET // 8:
                where[name] = tensor.untyped_storage().data_ptr()
        landed.append(where)
    return {"equal": all(equal), "large": sorted(landed[0]), "reused": landed[0] == landed[1]}


def send_empty(group, rank):
    return BucketSender(group).send([], version=4).buckets


def send_slowly(group, rank, marker):
    """A transfer that takes seconds (a slow input), to be killed part-way: `marker` appears once it is under way."""

    def slow():
        for i in range(40):
            time.sleep(0.1)
            if i == 10:
                open(marker, "w").close()
            yield f"t{i}", torch.full((4096,), float(i))

    manifest = [TensorSpec(f"t{i}", "float32", (4096,)) for i in range(40)]
    BucketSender(group, bucket_bytes=SMALL_BUCKET, timeout=5).send(slow(), version=1, manifest=manifest)
    return "finished"


def send_large(group, rank, timeout=5.0):
    tensors = {f"t{i}": torch.randn(1 << 20) for i in range(64)}  # 256 MB in 4 MB buckets
    BucketSender(group, bucket_bytes=4 << 20, timeout=timeout).send(tensors, version=1)
    return "finished"


def send_failing_input(group, rank):
    def broken():
        yield "ok", torch.ones(3)
        raise RuntimeError("merge exploded")

    BucketSender(group, bucket_bytes=SMALL_BUCKET).send(
        broken(), version=1, manifest=[TensorSpec("ok", "float32", (3,))]
    )


def send_corrupted(group, rank):
    sender = BucketSender(group, bucket_bytes=SMALL_BUCKET, verify=True, direct_bytes=SMALL_BUCKET // 8)
    broadcast = sender.wire.broadcast
    seen = {"controls": 0, "since_control": 0}

    def flip_a_byte_on_the_wire(tensor):  # fault injection: after the checksums were computed
        if tensor.numel() == CONTROL_BYTES:  # a bucket's control message (with its header inline)
            seen["controls"] += 1
            seen["since_control"] = 0
        else:
            seen["since_control"] += 1
        if seen["controls"] == 2 and seen["since_control"] == 1:  # bucket 1's first data message
            tensor = tensor.clone()
            tensor[tensor.numel() // 2] ^= 1
        return broadcast(tensor)

    sender.wire.broadcast = flip_a_byte_on_the_wire
    sender.send(mixed_tensors(), version=1)


def send_lying_manifest(group, rank):
    """Fault injection: the transfer header announces "big" with another shape (same bytes) than its buckets carry."""
    sender = BucketSender(group, bucket_bytes=SMALL_BUCKET, direct_bytes=SMALL_BUCKET // 8)
    broadcast_bytes = sender.wire.broadcast_bytes

    def lie(raw, what):
        header = TransferHeader.decode(raw)
        header.manifest = [spec._replace(shape=(200, 200)) if spec.name == "big" else spec for spec in header.manifest]
        return broadcast_bytes(header.encode(), what)

    sender.wire.broadcast_bytes = lie
    sender.send(mixed_tensors(), version=1)


def load_lied_to(group, rank):
    """Load into a module shaped like the announced manifest: nothing of "big" may land in it."""
    tensors = {name: (t.reshape(200, 200) if name == "big" else t) for name, t in mixed_tensors().items()}
    holder = Holder(tensors)
    try:
        BucketReceiver(group, timeout=10).load_into(holder)
    except Exception as e:
        big = holder.state_dict()["big"]
        return {"error": type(e).__name__, "message": str(e), "big_untouched": bool((big == 0).all())}
    return {"error": None}


def send_other_protocol(group, rank):
    sender = BucketSender(group)
    sender.wire.broadcast_bytes(TransferHeader(1, "weights", 1 << 20, False, [], protocol=99).encode(), "header")
    return "sent"


def send_adapter(group, rank):
    tensors = {
        "base_model.model.q_proj.lora_A.weight": torch.randn(4, 48),
        "base_model.model.q_proj.lora_B.weight": torch.randn(48, 4),
    }
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    return BucketSender(group, bucket_bytes=SMALL_BUCKET).send_adapter(tensors, config, version=9).version


# --- receivers -----------------------------------------------------------------------------------------------------


def receive_all(group, rank):
    receiver = BucketReceiver(group)
    got = {name: t.clone() for name, t in receiver.receive()}
    want = mixed_tensors()
    return {
        "version": receiver.version,
        "names": list(got),
        "equal": all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want),
    }


def load_module(group, rank, strict=True):
    target = Holder(mixed_tensors())
    receiver = BucketReceiver(group)
    version = receiver.load_into(target, strict=strict)
    want = mixed_tensors()
    return {"version": version, "equal": all(torch.equal(target.state_dict()[n], want[n]) for n in want)}


def load_mismatched_module(group, rank):
    tensors = mixed_tensors()
    tensors["layer.0.weight"] = torch.zeros(48, 47)  # wrong shape
    target = Holder(tensors)
    try:
        BucketReceiver(group).load_into(target)
    except ValueError as e:
        untouched = all((t == 0).all() for t in target.state_dict().values())
        return {"error": str(e), "untouched": bool(untouched)}
    return "loaded?!"


def load_into_holder_missing_one(group, rank, strict):
    tensors = mixed_tensors()
    tensors["extra"] = torch.zeros(2)  # the transfer lacks it
    target = Holder(tensors)
    try:
        return BucketReceiver(group).load_into(target, strict=strict)
    except ValueError as e:
        return f"ValueError: {e}"


class KeepsReferences:
    """A vLLM-like target whose load_weights keeps what it is given (as a lazy loader might)."""

    def __init__(self):
        self.kept = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.kept[name] = tensor


def load_weights_target(group, rank):
    target = KeepsReferences()
    version = BucketReceiver(group).load_into(target)
    want = mixed_tensors()
    return {"version": version, "equal": all(torch.equal(target.kept[n], want[n]) for n in want)}


def receive_versions(group, rank):
    receiver = BucketReceiver(group)
    seen = []
    for _ in range(3):
        values = {name: t.clone() for name, t in receiver.receive()}
        seen.append((receiver.version, float(values["w"][0])))
    return seen


def receive_count(group, rank):
    receiver = BucketReceiver(group)
    return {"tensors": len(list(receiver.receive())), "version": receiver.version}


def load_slowly(group, rank, marker):
    """Applies every tensor it gets, slowly (so a kill lands mid-transfer): `marker` appears once it is under way."""
    target = KeepsReferences()

    class Slow:
        def load_weights(self, weights):
            for name, tensor in weights:
                time.sleep(0.05)
                target.kept[name] = tensor
                if len(target.kept) == 5:
                    open(marker, "w").close()

    BucketReceiver(group, timeout=5).load_into(Slow())
    return "finished"


def load_module_with_timeout(group, rank):
    target = Holder({f"t{i}": torch.zeros(4096) for i in range(40)})
    receiver = BucketReceiver(group, timeout=5)
    started = time.monotonic()
    try:
        receiver.load_into(target)
    except Exception as e:
        applied = getattr(e, "applied", None)
        return {
            "error": type(e).__name__,
            "message": str(e)[:300],
            "applied": applied,
            "seconds": time.monotonic() - started,
            "version": receiver.version,
        }
    return "finished?!"


def expect_error(group, rank):
    receiver = BucketReceiver(group, timeout=5)
    try:
        for _ in receiver.receive():
            pass
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)[:300], "version": receiver.version}
    return "no error?!"


def stall(group, rank):
    time.sleep(8)  # alive but not receiving, well past the sender's 3 s timeout


def receive_adapter(group, rank):
    tensors, config, version = BucketReceiver(group).receive_adapter()
    return {
        "names": sorted(tensors),
        "shapes": [list(t.shape) for t in tensors.values()],
        "config": config,
        "version": version,
    }


def send_noting_the_collector(group, rank):
    """The mixed tensors from a lazy iterator that notes whether Python's collector is enabled as each is taken."""
    tensors = mixed_tensors()
    manifest = [TensorSpec.of(n, t) for n, t in tensors.items()]
    seen = []

    def pairs():
        for item in tensors.items():
            seen.append(gc.isenabled())
            yield item

    BucketSender(group, bucket_bytes=SMALL_BUCKET).send(pairs(), version=1, manifest=manifest)
    return {"during": set(seen), "after": gc.isenabled()}


class NotesTheCollector:
    """A `load_weights` target that notes whether Python's collector is enabled as each tensor arrives."""

    def __init__(self):
        self.seen = []

    def load_weights(self, weights):
        for _ in weights:
            self.seen.append(gc.isenabled())


def load_noting_the_collector(group, rank):
    target = NotesTheCollector()
    BucketReceiver(group).load_into(target)
    return {"during": set(target.seen), "after": gc.isenabled()}
