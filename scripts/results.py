"""Benchmark results as data: one JSON-lines file per benchmark, every row stamped with the machine, date, commit and
settings of its run; the data tables of `benchmarks/RESULTS.md` are made from those files by this script.

    uv run --group bench python benchmarks/step_vs_trl.py --quick \\
        | python scripts/results.py record step_vs_trl --machine cpu-2x-epyc-zen4 --settings quick
    python scripts/results.py tables                                         # rewrite RESULTS.md's data tables
    python scripts/results.py tables --check                                 # exit 1 if they differ from the data

`record` stamps the rows with `--machine` (as the files name machines: cpu-2x-epyc-zen4, h200…), today's date, the
checkout's commit and `--settings`. History stays in git: a run is rows in its benchmark's file, never a file of its
own.
"""

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
STAMP = ("machine", "date", "commit", "settings")


def spread(values: list[float], unit: str = "", digits: int = 2) -> str:
    """`lo–hi` (or one value) of `values`, with `unit`."""
    lo, hi = min(values), max(values)
    return (
        f"{lo:.{digits}f}{unit}" if round(lo, digits) == round(hi, digits) else f"{lo:.{digits}f}–{hi:.{digits}f}{unit}"
    )


def by(rows: list[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get(key)), []).append(row)
    return groups


def per_case(rows: list[dict], key: str, field: str, unit: str = "×") -> str:
    return ", ".join(f"{case} {spread([r[field] for r in group if field in r], unit)}"
                     for case, group in by(rows, key).items() if any(field in r for r in group))  # fmt: skip


def step_vs_trl(rows: list[dict]) -> str:
    return (f"speedup over TRL: {per_case(rows, 'case', 'speedup')}; "
            f"memory {spread([r['memory_ratio'] for r in rows])} of TRL's")  # fmt: skip


def learning_vs_trl(rows: list[dict]) -> str:
    parts = [f"{key} {row[key]:.3g}" for row in rows if row.get("summary") for key in
             ("time_ratio", "lorarl_peak_mean", "lorarl_final_mean") if isinstance(row.get(key), float)]  # fmt: skip
    return "; ".join(parts) or f"{len(rows)} rows"


def multiturn_vs_trl(rows: list[dict]) -> str:
    speed = [r for r in rows if "speedup" in r]
    parts = []
    if speed:
        parts.append(f"speedup over TRL: {per_case(speed, 'case', 'speedup')}; memory "
                     f"{spread([r['memory_ratio'] for r in speed])} of TRL's")  # fmt: skip
    learning = learning_vs_trl([r for r in rows if r.get("summary")])
    return "; ".join([*parts, learning] if any(r.get("summary") for r in rows) else parts) or f"{len(rows)} rows"


def tenants(rows: list[dict]) -> str:
    summary = [r for r in rows if r.get("summary") and r["tenants"] > 1]
    named = {"hf": ""}  # the sampler, named where it is not the default
    return "; ".join(f"{r['model']}{named.get(r.get('sampler', 'hf'), ' ' + str(r.get('sampler')))} x{r['tenants']}: "
                     f"{r['throughput_ratio']:.2f}x one tenant's steps/s "
                     f"(sampled tokens {r['sampled_tokens_ratio']:.2f}x) at {r['memory_ratio']:.2f}x its memory"
                     for r in summary) or f"{len(rows)} rows"  # fmt: skip


def mixed_update(rows: list[dict]) -> str:
    return "; ".join(f"{r['model']} x{r['tenants']}: mixed-adapter batch {r['mixed_speedup']:.2f}x the "
                     f"time-multiplexed round's speed (gradients' max rel. diff {r['gradient_max_rel_diff']:.1g})"
                     for r in rows)  # fmt: skip


def cookbook_math_rl(rows: list[dict]) -> str:
    summary = [r for r in rows if r.get("summary")]
    if not summary:
        return f"{len(rows)} rows"
    last = summary[-1]
    reward = last["env/all/reward/total"]
    alone, together = (", ".join(f"{v:.3f}" for v in reward[k]) for k in ("alone", "two_at_once"))
    pace = {}  # steps per second of all the runs on one server (each run's wall: the sum of its steps' times)
    for count in (1, 2):
        runs = [r for r in rows if r.get("runs_at_once") == count]
        walls = [sum(s["time/total"] for s in r["steps"]) for r in runs]
        pace[count] = sum(len(r["steps"]) for r in runs) / len(runs) * count / max(walls) if runs else 0
    return (f"mean reward over steps {last['window_from_step']}+: alone {alone}; two at once {together} (first 3 "
            f"steps: {min(reward['first_steps']):.3f} to {max(reward['first_steps']):.3f}); two runs at once "
            f"{pace[2] / pace[1]:.2f}x one's steps per second")  # fmt: skip


def merge_throughput(rows: list[dict]) -> str:
    parts = []
    for backend, group in by([r for r in rows if r.get("case") == "layer"], "backend").items():
        ratios = [r["ratio_to_copy"] for r in group]
        parts.append(f"{backend} median {statistics.median(ratios):.2f} ({spread(ratios)})")
    headline = ["ratio to copy_: " + "; ".join(parts)] if parts else []
    for backend, group in by([r for r in rows if r.get("case") == "experts"], "backend").items():
        headline.append(f"{backend} grouped merge of experts over the dense merge of their bytes: "
                        f"{spread([r['ratio_to_dense'] for r in group])}x GB/s")  # fmt: skip
    return "; ".join(headline) or f"{len(rows)} rows"


def sync_throughput(rows: list[dict]) -> str:
    return "ratio to the raw broadcast: " + per_case(rows, "payload", "ratio_to_raw", "")


def sync_modes(rows: list[dict]) -> str:
    measured = [{**r, "where": f"{r['case']} on {r['engine']}", "ratio": r["factors"]["sync_s_vs_merged"]}
                for r in rows if isinstance(r.get("factors"), dict)]  # fmt: skip
    return "factor sync's time over merged sync's: " + per_case(measured, "where", "ratio")


def rollout_throughput(rows: list[dict]) -> str:
    return "vLLM's speed over the HF engine's: " + per_case(rows, "case", "speedup")


def multiturn_rollout(rows: list[dict]) -> str:
    hf, vllm = ([r[f"{side}_episodes_per_s"] for r in rows] for side in ("hf", "vllm"))
    memory = {side: spread([r[f"{side}_peak_rss_gb"] for r in rows], " GB") for side in ("hf", "vllm")}
    return (f"episodes/s: HF {spread(hf, '', 0)}, vLLM {spread(vllm, '', 0)} "
            f"({spread([r['vllm_over_hf'] for r in rows], '×')} of HF's); peak memory HF {memory['hf']}, "
            f"vLLM {memory['vllm']}")  # fmt: skip


def decode_head(rows: list[dict]) -> str:
    return f"sliced head over the whole: {spread([r['sliced_over_whole'] for r in rows])}"


def gradient_checkpointing(rows: list[dict]) -> str:
    return (f"memory {spread([r['memory_ratio'] for r in rows])} with it, "
            f"time {spread([r['time_ratio'] for r in rows])}")  # fmt: skip


def under_load(rows: list[dict]) -> str:
    loaded = [r for r in rows if r["competitors"]]
    parts = [f"{r['job']} beside {r['competitors']} {r['competitor']}: lorarl {r['lorarl_slowdown']:.2f}x "
             f"(bound {r['bound']:.1f}x), TRL {r['trl_slowdown']:.2f}x" for r in loaded]  # fmt: skip
    return "slowdown against each side's quiet step: " + "; ".join(parts) if parts else f"{len(rows)} rows"


def env_latency(rows: list[dict]) -> str:
    parts = [f"tool {r['tool_delay_s']:g} s: {r['lorarl_s_per_step']:.2f} s/step, {r['speedup_vs_trl']:.2f}x TRL, "
             f"{r['speedup_vs_one_at_a_time']:.2f}x one call at a time" for r in rows]  # fmt: skip
    return "; ".join(parts)


def agent_latency(rows: list[dict]) -> str:
    parts = []
    latency = [r for r in rows if r["part"] == "latency" and r["latency_s"] > 0]
    if latency:
        held = sum(r["within_bound"] for r in latency)
        worst = max(latency, key=lambda r: r["s_per_step"] / r["bound_s_per_step"])
        parts.append(f"{held}/{len(latency)} latency cases within zero-latency step + 1.5 x turns x L (closest: "
                     f"{worst.get('task', 'default')} {worst['engine']} {worst['env']} {worst['turns']} turns at "
                     f"{worst['latency_s']:g} s, {worst['s_per_step']:.2f} of {worst['bound_s_per_step']:.2f} "
                     "s)")  # fmt: skip
    parts += [f"max_staleness={r['max_staleness']}{' with in-flight updates' if r.get('in_flight_updates') else ''} "
              f"at {r['latency_s']:g} s: {r['steps_per_s_ratio']:.2f}x on-policy steps/s (actions' lag "
              f"{r['action_version_lag']:.2f})" for r in rows if r["part"] == "staleness"]  # fmt: skip
    cpu = [r for r in rows if r["part"] == "cpu" and r["env_processes"]]
    if cpu:
        sides = ", ".join(f"env.processes={r['env_processes']} {r['steps_per_s_ratio']:.2f}x (memory "
                          f"{r['peak_rss_gb'] / r['in_process_peak_rss_gb']:.2f})" for r in cpu)  # fmt: skip
        parts.append(f"{cpu[0]['cpu_s_per_env_step'] * 1000:g} ms of CPU an env step: {sides} the in-process steps/s")
    for r in (r for r in rows if r["part"] == "trl"):
        sides = [("on-policy", "lorarl"), ("max_staleness=1", "lorarl_stale1"), ("max_staleness=2", "lorarl_stale2")]
        parts.append("0.1 s tool against TRL: " + ", ".join(
            f"{name} {r[f'{side}_speedup_vs_trl']:.1f}x (memory {r[f'{side}_memory_ratio']:.2f})"
            for name, side in sides if f"{side}_speedup_vs_trl" in r))  # fmt: skip
    return "; ".join(parts)


def stale_learning(rows: list[dict]) -> str:
    return "; ".join(f"max_staleness={r['max_staleness']}: final accuracy {r['mean_final_accuracy']:.3f} (target "
                     f"{r['target_accuracy']:.3f}), reached at steps {r['reached_step']}" for r in rows)  # fmt: skip


def routing_replay(rows: list[dict]) -> str:
    parts = []
    mismatch = [r for r in rows if r["part"] == "mismatch" and r["engine_dtype"] == "bfloat16"]
    for off, on in zip(mismatch[::2], mismatch[1::2], strict=True):
        same = "abs_logp_diff_on_tokens_rerouted_without_replay"
        parts.append(f"{off['model']} (bf16 engine): {off['rollout/route_mismatch']:.1%} of tokens rerouted, "
                     f"|Δ log p| on them {off[same]:.4f} -> {on[same]:.4f} with replay "
                     f"({on[same] / off[same]:.2f}x; every token {on['rollout/abs_logp_diff']:.4f})")  # fmt: skip
    learning = {r["replay"]: r for r in rows if r["part"] == "learning"}
    if learning:
        parts.append("; ".join(f"{'with' if replay else 'without'} replay: final accuracy "
                               f"{spread(r['final_accuracy'], digits=3)} (mean {r['mean_final_accuracy']:.3f})"
                               for replay, r in learning.items()))  # fmt: skip
    parts += [f"step {r['side']}: {r['ratio_to_off']:.3f}x routes off" for r in rows if r["part"] == "overhead"]
    return "; ".join(parts)


def verifiers_v1_overhead(rows: list[dict]) -> str:
    return "; ".join(f"{r['episodes']} episodes at once: verifiers' own loop {r['verifiers_s_per_episode']:.2f} s an "
                     f"episode, lorarl {r['lorarl_s_per_episode']:.2f} s (+{r['added_s_per_episode']:.3f} s, "
                     f"{r['ratio']:.2f}x)" for r in rows)  # fmt: skip


def gpu_check(rows: list[dict]) -> str:
    return ", ".join(f"{r['check']} {r['status']}" for r in rows if r["check"] != "environment")


# each benchmark: its data file, and the headline of a run (its rows)
BENCHMARKS: dict[str, tuple[Path, Callable[[list[dict]], str]]] = {
    "step_vs_trl": (ROOT / "benchmarks/results/step_vs_trl.jsonl", step_vs_trl),
    "learning_vs_trl": (ROOT / "benchmarks/results/learning_vs_trl.jsonl", learning_vs_trl),
    "multiturn_vs_trl": (ROOT / "benchmarks/results/multiturn_vs_trl.jsonl", multiturn_vs_trl),
    "tenants": (ROOT / "benchmarks/results/tenants.jsonl", tenants),
    "mixed_update": (ROOT / "benchmarks/results/mixed_update.jsonl", mixed_update),
    "cookbook_math_rl": (ROOT / "benchmarks/results/cookbook_math_rl.jsonl", cookbook_math_rl),
    "sync_modes": (ROOT / "benchmarks/results/sync_modes.jsonl", sync_modes),
    "rollout_throughput": (ROOT / "benchmarks/results/rollout_throughput.jsonl", rollout_throughput),
    "multiturn_rollout": (ROOT / "benchmarks/results/multiturn_rollout.jsonl", multiturn_rollout),
    "decode_head": (ROOT / "benchmarks/results/decode_head.jsonl", decode_head),
    "gradient_checkpointing": (ROOT / "benchmarks/results/gradient_checkpointing.jsonl", gradient_checkpointing),
    "under_load": (ROOT / "benchmarks/results/under_load.jsonl", under_load),
    "env_latency": (ROOT / "benchmarks/results/env_latency.jsonl", env_latency),
    "agent_latency": (ROOT / "benchmarks/results/agent_latency.jsonl", agent_latency),
    "stale_learning": (ROOT / "benchmarks/results/stale_learning.jsonl", stale_learning),
    "routing_replay": (ROOT / "benchmarks/results/routing_replay.jsonl", routing_replay),
    "verifiers_v1_overhead": (ROOT / "benchmarks/results/verifiers_v1_overhead.jsonl", verifiers_v1_overhead),
    "gpu_check": (ROOT / "benchmarks/results/gpu_check.jsonl", gpu_check),
    "merge_throughput": (ROOT / "packages/lora_merge/benchmarks/results/merge_throughput.jsonl", merge_throughput),
    "sync_throughput": (ROOT / "packages/weight_sync/benchmarks/results/sync_throughput.jsonl", sync_throughput),
}


def read(benchmark: str) -> list[dict]:
    path = BENCHMARKS[benchmark][0]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def runs(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """The rows grouped by their stamp (a run), newest first (by date, then the later recorded)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in STAMP), []).append(row)
    order = {stamp: index for index, stamp in enumerate(groups)}
    return sorted(groups.items(), key=lambda item: (item[0][1], order[item[0]]), reverse=True)


def table(benchmark: str) -> str:
    headline = BENCHMARKS[benchmark][1]
    lines = ["| machine | date | commit | settings | result |", "|---|---|---|---|---|"]
    for (machine, date, commit, settings), group in runs(read(benchmark)):
        lines.append(f"| {machine} | {date} | {commit} | {settings or '—'} | {headline(group)} |")
    return "\n".join(lines)


def rendered(text: str) -> str:
    """`text` with each `<!-- data:NAME -->` … `<!-- /data -->` block holding NAME's table as the data make it."""

    def fill(match: re.Match) -> str:
        return f"<!-- data:{match[1]} -->\n{table(match[1])}\n<!-- /data -->"

    return re.sub(r"<!-- data:(\w+) -->\n.*?<!-- /data -->", fill, text, flags=re.S)


def record(benchmark: str, settings: str, machine: str) -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    stamp = {"machine": machine, "date": datetime.date.today().isoformat(), "commit": commit,
             "settings": settings}  # fmt: skip
    rows = [json.loads(line) for line in sys.stdin if line.strip().startswith("{")]
    with BENCHMARKS[benchmark][0].open("a") as data:
        for row in rows:
            data.write(json.dumps({**stamp, **{k: v for k, v in row.items() if k not in STAMP}}) + "\n")
    print(f"{len(rows)} rows recorded in {BENCHMARKS[benchmark][0]}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("record", help="stamp the JSON rows on stdin and append them to the benchmark's file")
    add.add_argument("benchmark", choices=BENCHMARKS)
    add.add_argument("--settings", default="", help="what set this run apart (e.g. quick, bf16)")
    add.add_argument("--machine", required=True, help="the machine, as the file names it (e.g. cpu-2x-epyc-zen4, h200)")
    tables = verbs.add_parser("tables", help="rewrite RESULTS.md's data tables from the data")
    tables.add_argument("--check", action="store_true", help="only say whether they are current (exit 1 if not)")
    args = parser.parse_args()
    if args.verb == "record":
        return record(args.benchmark, args.settings, args.machine)
    text = RESULTS_MD.read_text()
    if args.check:
        return int(rendered(text) != text)
    RESULTS_MD.write_text(rendered(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
