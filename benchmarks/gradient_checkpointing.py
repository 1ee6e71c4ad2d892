"""lorarl's step with and without `actor.gradient_checkpointing` on the same work: one JSON object per case.

Each case runs lorarl's trainer in processes of its own, interleaved off, on, off, on, with the settings of
`step_vs_trl.py` (a bf16 base by default) and longer responses than there (64 new tokens), where the activations
weigh. Per case: seconds per step and the peak resident memory of the process tree on each side (as `step_vs_trl`
measures them), `time_ratio` (on / off: the cost of the recompute) and `memory_ratio` (on / off).

    uv run --group bench python benchmarks/gradient_checkpointing.py [--quick] [--cases smollm2-135m-shaped,...]
        [--max-tokens 64] [--train-dtype bfloat16|float32] [--repeats 2]
"""

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from step_vs_trl import CASES, Settings, make_model, run_side, summary


def measure(case, workdir: Path, *, quick: bool, repeats: int, settings: Settings) -> dict:
    model = make_model(case, workdir)
    steps = case.warmup + (max(2, case.steps // 3) if quick else case.steps)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(repeats):
        for flag in (False, True):  # interleaved: off, on, off, on
            on = dataclasses.replace(settings, gradient_checkpointing=flag)
            runs[flag].append(run_side("lorarl", case, model, workdir, steps, on))
    out = {"case": case.name, "prompts": case.prompts, "max_tokens": case.max_tokens,
           "train_dtype": settings.train_dtype}  # fmt: skip
    out.update(summary("off", runs[False]))
    out.update(summary("on", runs[True]))
    out["time_ratio"] = out["on_s_per_step"] / out["off_s_per_step"]
    out["memory_ratio"] = out["on_peak_rss_gb"] / out["off_peak_rss_gb"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--cases", default="smollm2-135m-shaped", help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per response")
    parser.add_argument("--train-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per case, interleaved")
    args = parser.parse_args()
    unknown = [n for n in args.cases.split(",") if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected names from {list(CASES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lorarl.lora_merge import available_backends

    available_backends("cpu")  # the C++ merge op built (or found cached) before the runs, not inside the first
    settings = Settings("auto", args.train_dtype, False, "cpu")
    with tempfile.TemporaryDirectory(prefix="gradient_checkpointing-") as workdir:
        for name in args.cases.split(","):
            case = dataclasses.replace(CASES[name], max_tokens=args.max_tokens)
            result = measure(case, Path(workdir), quick=args.quick, repeats=args.repeats, settings=settings)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
