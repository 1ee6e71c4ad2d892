"""The decode's LM head on CPU: one GEMM over the whole vocabulary against `decode.vocab_sliced`, one JSON object each.

A decode step multiplies a few rows of hidden states (the sequences being sampled) by the whole fp32 head. Per shape
and row count it times, interleaved over repetitions, `F.linear` with the whole head and the head applied in slices of
`HEAD_SLICE_BYTES` of its weight (the trainer's setting) and of half and twice that; it prints the medians in ms and
`sliced_over_whole` (< 1: slicing is faster).

    uv run python benchmarks/decode_head.py [--rows 16,64] [--repeats 15]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from lorarl.trainer import decode

SHAPES = [(32768, 512), (49152, 576), (151936, 896)]  # (vocab, hidden): the 46M case, SmolLM2-135M, Qwen2-0.5B


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64", help="hidden-state rows per GEMM (sequences decoded at once)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    slice_bytes = {"half": decode.HEAD_SLICE_BYTES // 2, "sliced": decode.HEAD_SLICE_BYTES,
                   "double": 2 * decode.HEAD_SLICE_BYTES}  # fmt: skip
    for vocab, hidden in SHAPES:
        head = torch.nn.Linear(hidden, vocab, bias=False)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, hidden)
            variants = {"whole": lambda x=x, head=head: F.linear(x, head.weight)}
            for name, size in slice_bytes.items():
                variants[name] = lambda x=x, size=size, head=head: sliced_logits(head, x, size)
            times: dict[str, list[float]] = {name: [] for name in variants}
            with torch.no_grad():
                for fn in variants.values():  # warm-up, and the slices checked against the whole
                    torch.testing.assert_close(fn(), variants["whole"](), rtol=1e-4, atol=1e-4)
                for _ in range(args.repeats):
                    for name, fn in variants.items():
                        started = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - started)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(json.dumps({"vocab": vocab, "hidden": hidden, "rows": rows,
                              "slice_bytes": decode.HEAD_SLICE_BYTES, **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                              "sliced_over_whole": round(ms["sliced"] / ms["whole"], 3),
                              "half_over_whole": round(ms["half"] / ms["whole"], 3),
                              "double_over_whole": round(ms["double"] / ms["whole"], 3)}), flush=True)  # fmt: skip


def sliced_logits(head: torch.nn.Linear, x: torch.Tensor, size: int) -> torch.Tensor:
    previous, decode.HEAD_SLICE_BYTES = decode.HEAD_SLICE_BYTES, size
    try:
        with decode.vocab_sliced(head):
            return head(x)
    finally:
        decode.HEAD_SLICE_BYTES = previous


if __name__ == "__main__":
    main()
