"""`uv run trainer [CONFIG.yaml] [key=value ...]`, `uv run trainer --help`,
`uv run trainer export --checkpoint DIR --merged OUT`,
`uv run trainer eval --checkpoint DIR [--n 8] [key=value ...]`."""

import argparse
import atexit
import json
import os
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from lorarl.trainer.config import ConfigError, help_text, load_config, task_names
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.interrupt import StopRequest
from lorarl.trainer.presets import PRESETS, presets_help

USAGE = """usage: trainer [CONFIG.yaml] [key=value ...]
       trainer --help [CONFIG.yaml] [key=value ...]     (with the settings of the plugins they name)
       trainer export --checkpoint DIR --merged OUT
       trainer eval --checkpoint DIR [--val-files FILE ...] [--n 8] [--out FILE.json] [key=value ...]
       trainer serve [--base MODEL ...] [--port 8000] ...   (the Tinker API; trainer serve --help)

GRPO-family RL with LoRA. With no arguments: the embedded default (a small model learning multi-digit addition), on
CPU, in about a minute. Shipped tasks: task=<{tasks}> (a model, data and settings; task=calculator: the embedded
multi-turn task). Presets: algorithm=<{presets}>.
"""


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    argv = sys.argv[1:] if argv is None else argv
    console = Console(highlight=False, soft_wrap=True)
    try:
        if argv and argv[0] in ("-h", "--help"):  # with a config: its plugins' settings too
            files, overrides = _split(argv[1:])
            text = help_text(files[0] if files else None, overrides, presets=PRESETS)
            usage = USAGE.format(presets="|".join(PRESETS), tasks="|".join(task_names()))
            console.print(usage, presets_help(), "", text, sep="\n", markup=False)
            return 0
        if argv and argv[0] == "export":
            return _export(argv[1:], console)
        if argv and argv[0] == "eval":
            return _eval(argv[1:], console)
        if argv and argv[0] == "serve":
            from lorarl.trainer.serve.server import main as serve

            return serve(argv[1:])
        files, overrides = _split(argv)
        config = load_config(files[0] if files else None, overrides, presets=PRESETS)
        t = config.trainer
        if t.backend == "ray" and t.n_gpus_per_node * t.nnodes > 1 and "WORLD_SIZE" not in os.environ:
            from lorarl.trainer.ray_trainer import run_on_ray

            summary = run_on_ray(config)  # the ranks are Ray actors; rank 0 prints
        else:
            with StopRequest(lambda text: console.print(text, markup=False)) as stop:  # from the start: never lost
                from lorarl.trainer.loop import Trainer

                summary = Trainer(config, console=console).run(stop)
    except (ConfigError, TrainerError) as e:
        console.print(f"error: {e}", markup=False, style="red")
        return 2
    except KeyboardInterrupt:  # a second signal
        console.print("interrupted", markup=False, style="red")
        return 130
    finally:
        _leave_process_group()
    if not summary:  # a data-parallel rank other than 0: rank 0 reports
        return 0
    if summary.get("stopped_at"):
        keep = [a for a in argv if a.split("=", 1)[0] not in ("trainer.output_dir", "trainer.resume")]
        command = shlex.join(["uv", "run", "trainer", *keep, f"trainer.output_dir={summary['output_dir']}",
                              "trainer.resume=auto"])  # fmt: skip
        console.print(f"stopped after step {summary['stopped_at']} (checkpoint written); resume with:\n  {command}",
                      markup=False)  # fmt: skip
        return 143 if summary.get("stopped_by") == "SIGTERM" else 130
    start, end = summary["val_accuracy_start"], summary["val_accuracy_end"]
    console.print(f"done: {summary['steps']} steps; outputs in {summary['output_dir']}", markup=False)
    if start is not None and end is not None:
        console.print(f"validation accuracy: {start:.3f} at the start -> {end:.3f} at the end "
                      f"({100 * (end - start):+.1f} points)", markup=False)  # fmt: skip
    return 0


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The config file (at most one) and the key=value overrides."""
    files = [a for a in argv if "=" not in a]
    if len(files) > 1:
        raise ConfigError(f"at most one config file, got {files}")
    return files, [a for a in argv if "=" in a]


def _leave_process_group() -> None:
    """Data-parallel ranks (torchrun) leave their group cleanly (a run that never imported torch has none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def export_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer export", description="write a merged full model from a checkpoint")
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step_N directory")
    parser.add_argument("--merged", required=True, help="output directory for the merged model")
    return parser


def eval_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer eval", description="greedy accuracy and pass@k of a checkpoint "
                                     "(or a merged model) on validation data")  # fmt: skip
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step_N directory, or a merged model's")
    parser.add_argument("--val-files", nargs="+", help="validation data (default: the run's data.val_files)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt for pass@k (default 8)")
    parser.add_argument("--out", help="also write the results to this JSON file")
    return parser


def _export(argv: list[str], console) -> int:
    args = export_arguments().parse_args(argv)
    from lorarl.trainer.export import export_merged

    out = export_merged(args.checkpoint, args.merged)
    console.print(f"merged model written to {out}", markup=False)
    return 0


def _eval(argv: list[str], console) -> int:
    parser = eval_arguments()
    args, overrides = parser.parse_known_args(argv)
    if bad := [o for o in overrides if "=" not in o]:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    if args.val_files:
        overrides.append(f"data.val_files=[{','.join(args.val_files)}]")
    from rich.table import Table

    from lorarl.trainer.evaluation import evaluate_checkpoint

    results = evaluate_checkpoint(args.checkpoint, overrides, n=args.n)
    table = Table("measure", "value", title=f"{results['checkpoint']}: {results['prompts']} prompts")
    for key, value in results.items():
        if key not in ("checkpoint", "prompts"):
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
    text = json.dumps(results, indent=2)
    console.print(text, markup=False)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def run() -> NoReturn:
    """The `trainer` command. A torchrun rank (WORLD_SIZE > 1) runs its exit handlers, flushes its output and leaves
    with `os._exit`, skipping the interpreter's teardown: gloo's worker threads outlive `destroy_process_group`
    (DTensor's caches keep the group), and one that frees a collective's tensor after teardown has begun takes the GIL
    there and aborts the rank ("terminate called without an active exception", pytorch/pytorch#190489): a finished
    run would be reported as failed."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
