"""Weight-sync throughput between two processes: one JSON object per case, ratios against same-run baselines.

Payloads: a Qwen2-0.5B-shaped state dict in bf16 (~1 GB, 290 tensors) and 10,000 small fp32 tensors (~40 MB).
Per case (payload, bucket size):
  seconds / gbps          median time of `BucketSender.send` (sender side, until every receiver applied it:
                          transfer header, buckets, final status), tensor bytes / seconds
  ratio_to_raw            time of one `broadcast` of a single preallocated buffer holding the same bytes / seconds
  speedup_vs_per_tensor   time of broadcasting tensor by tensor (as TRL/OpenRLHF do) / seconds
  ratio_to_posted         time of every tensor's broadcast posted at once from its own memory, then waited for
                          (the floor for these tensors unpacked: what lies above it is the protocol's own) / seconds
  receive_ratio_to_posted the same ratio for `BucketReceiver.receive()`
  receive_ratio_to_raw    the same ratio for the iterator path, `BucketReceiver.receive()`, its tensors taken
  receive_copy_ratio_to_raw  ... and each copied into the preallocated one of its name (as vLLM's `load_weights`
                          copies what it is given)
The receiver loads into preallocated tensors of the same names (`load_into` a module, as a rollout engine does),
like the baselines, which also receive into preallocated memory.

    uv run python packages/weight_sync/benchmarks/sync_throughput.py [--quick] [--backend gloo|nccl] [--gloo-threads N]
"""

import argparse
import functools
import json
import multiprocessing as mp
import statistics
import time

import torch
import torch.distributed as dist

from lorarl.weight_sync import BucketReceiver, BucketSender, create_sync_group, free_port
from lorarl.weight_sync.group import GLOO_THREADS
from lorarl.weight_sync.sender import DEFAULT_DIRECT_BYTES

MB = 1 << 20


def qwen2_half_b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of Qwen2.5-0.5B's state dict (tied embeddings: lm_head is sent under its own name too)."""
    hidden, inter, kv, vocab = 896, 4864, 128, 151936
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(24):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
        ]  # fmt: skip
    return [*shapes, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def payload(kind: str, device: torch.device) -> dict[str, torch.Tensor]:
    if kind == "qwen2-0.5b-bf16":
        return {name: torch.randn(shape, device=device).bfloat16() for name, shape in qwen2_half_b_shapes()}
    sizes = torch.randint(64, 1984, (10_000,), generator=torch.Generator().manual_seed(0))
    return {f"small.{i}": torch.randn(int(n), device=device) for i, n in enumerate(sizes)}


def timed(group: dist.ProcessGroup, fn) -> float:
    """Seconds of fn() on this rank, all ranks starting together (a barrier by all-reduce)."""
    flag = torch.zeros(1, device=device_of(group))
    group.allreduce([flag]).wait()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def device_of(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if group.name() == "nccl" else torch.device("cpu")


def post(group, tensor: torch.Tensor) -> dist.Work:
    """A broadcast from rank 0, started."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def broadcast(group, tensor: torch.Tensor) -> None:
    post(group, tensor).wait()


def per_tensor(group, tensors: dict[str, torch.Tensor]) -> None:
    for tensor in tensors.values():
        broadcast(group, tensor)


def posted(group, tensors: dict[str, torch.Tensor]) -> None:
    for work in [post(group, tensor) for tensor in tensors.values()]:
        work.wait()


class Engine(torch.nn.Module):
    """Stands for a rollout engine's model: preallocated tensors under the sent names."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return self.tensors


def bucketed(sender: BucketSender | None, receiver: BucketReceiver | None, tensors: dict[str, torch.Tensor],
             consumer: str = "load_into") -> None:  # fmt: skip
    """One transfer; the receiving side `load_into` a module, or iterates `receive()` copying each tensor into its
    preallocated one ("receive_copy", as vLLM's `load_weights` does) or only taking it ("receive")."""
    if sender is not None:
        sender.send(tensors, version=1)
    elif consumer == "load_into":
        receiver.load_into(Engine(tensors))
    else:
        for name, tensor in receiver.receive():
            if consumer == "receive_copy":
                tensors[name].copy_(tensor)


def run(rank: int, port: int, backend: str, quick: bool, direct_mb: float, gloo_threads: int, results) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = create_sync_group("127.0.0.1", port, 2, rank, backend=backend, timeout=600, gloo_threads=gloo_threads)
    device = device_of(group)
    repeats = 3 if quick else 5
    bucket_sizes = [16, 64, 256]
    for kind in ("qwen2-0.5b-bf16", "10k-small-fp32"):
        tensors = (
            payload(kind, device) if rank == 0 else {n: torch.empty_like(t) for n, t in payload(kind, device).items()}
        )
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        raw = torch.empty(total, dtype=torch.uint8, device=device)
        if rank == 0:  # the payload's bytes: an untouched buffer reads as the kernel's one shared zero page (cached)
            torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()], out=raw)
        else:
            raw.zero_()
        direct = int(direct_mb * MB)
        sender = (
            {b: BucketSender(group, bucket_bytes=b * MB, direct_bytes=direct) for b in bucket_sizes}
            if rank == 0
            else None
        )
        receiver = {b: BucketReceiver(group) for b in bucket_sizes} if rank == 1 else None  # one per size, as real use

        times = {
            "raw": [],
            "per_tensor": [],
            "posted": [],
            **{b: [] for b in bucket_sizes},
            **{(b, consumer): [] for b in bucket_sizes for consumer in ("receive", "receive_copy")},
        }
        for _ in range(repeats):  # every measurement in turn, so drift hits all alike
            times["raw"].append(timed(group, functools.partial(broadcast, group, raw)))
            times["per_tensor"].append(timed(group, functools.partial(per_tensor, group, tensors)))
            times["posted"].append(timed(group, functools.partial(posted, group, tensors)))
            for b in bucket_sizes:
                for key, consumer in (
                    (b, "load_into"),
                    ((b, "receive"), "receive"),
                    ((b, "receive_copy"), "receive_copy"),
                ):
                    transfer = functools.partial(
                        bucketed, sender and sender[b], receiver and receiver[b], tensors, consumer
                    )
                    times[key].append(timed(group, transfer))
        if rank == 0:
            median = {k: statistics.median(v) for k, v in times.items()}
            for b in bucket_sizes:
                results.put({
                    "payload": kind, "backend": backend, "tensors": len(tensors), "bytes": total, "bucket_mb": b,
                    "direct_mb": direct_mb, "gloo_threads": gloo_threads if backend == "gloo" else None,
                    "seconds": round(median[b], 4), "gbps": round(total / median[b] / 1e9, 3),
                    "ratio_to_raw": round(median["raw"] / median[b], 3),
                    "speedup_vs_per_tensor": round(median["per_tensor"] / median[b], 2),
                    "ratio_to_posted": round(median["posted"] / median[b], 3),
                    "receive_ratio_to_posted": round(median["posted"] / median[(b, "receive")], 3),
                    "receive_ratio_to_raw": round(median["raw"] / median[(b, "receive")], 3),
                    "receive_copy_ratio_to_raw": round(median["raw"] / median[(b, "receive_copy")], 3),
                    "raw_seconds": round(median["raw"], 4), "per_tensor_seconds": round(median["per_tensor"], 4),
                    "posted_seconds": round(median["posted"], 4),
                })  # fmt: skip
        del tensors, raw
    results.put(None if rank == 0 else "done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--direct-mb", type=float, default=DEFAULT_DIRECT_BYTES / MB, help="direct_bytes, in MB")
    parser.add_argument("--gloo-threads", type=int, default=GLOO_THREADS, help="worker threads of the gloo group")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=run, args=(r, port, args.backend, args.quick, args.direct_mb, args.gloo_threads, results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    finished = 0
    while finished < 2:
        item = results.get(timeout=1800)
        if item is None or item == "done":
            finished += 1
        else:
            print(json.dumps(item), flush=True)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
