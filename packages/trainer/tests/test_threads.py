"""Threads sized to the cores and the load (`lorarl.trainer.threads`): the cgroup quota read from the kernel's file
formats, the affinity from the kernel, a count that drops beside real competing processes and returns once they stop,
and the fixed counts a user sets. Each process-wide case runs in a fresh interpreter."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from trainer_fixtures import tiny_overrides

from lorarl.trainer.threads import cgroup_quota, threads_for

CORES = len(os.sched_getaffinity(0))


def run_python(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_threads_are_the_cores_the_others_leave_idle():
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.2) == 2  # a core the others keep 80% idle counts as free
    assert threads_for(2, 0.3) == 1
    assert threads_for(2, 1.0) == 1
    assert threads_for(2, 5.0) == 1  # never none
    assert threads_for(16, 3.9) == 12
    assert threads_for(16, 0.0) == 16


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    write(tmp_path / "self", "0::/jobs/run\n")
    write(tmp_path / "fs/jobs/cpu.max", "150000 100000\n")
    write(tmp_path / "fs/jobs/run/cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path / "fs", tmp_path / "self") == 1.5
    write(tmp_path / "fs/jobs/run/cpu.max", "50000 100000\n")
    assert cgroup_quota(tmp_path / "fs", tmp_path / "self") == 0.5


def test_the_cgroup_v1_quota_and_no_quota(tmp_path):
    write(tmp_path / "self", "5:memory:/x\n4:cpu,cpuacct:/job\n0::/\n")
    write(tmp_path / "fs/cpu,cpuacct/job/cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "fs/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(tmp_path / "fs", tmp_path / "self") == 3.0
    write(tmp_path / "fs/cpu,cpuacct/job/cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota(tmp_path / "fs", tmp_path / "self") is None
    assert cgroup_quota(tmp_path / "fs", tmp_path / "missing") is None


def test_the_cores_available_follow_the_affinity():
    cpu = min(os.sched_getaffinity(0))
    code = f"""
        import os
        os.sched_setaffinity(0, {{{cpu}}})
        from lorarl.trainer import threads
        print(threads.available_cores(), threads.configure().count)
    """
    assert run_python(code) == "1 1"


def test_the_machine_s_busy_time_counts_a_busy_process():
    code = """
        import os, subprocess, sys, time
        from lorarl.trainer import threads

        cpus = frozenset(os.sched_getaffinity(0))
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        before = threads.machine_busy_s(cpus)
        time.sleep(2.0)
        after = threads.machine_busy_s(cpus)
        with open(f"/proc/{spin.pid}/stat") as stat:
            ticks = stat.read().rsplit(")", 1)[1].split()
        spin.kill()
        print(after - before, (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK"))
    """
    machine, spinner = map(float, run_python(code).split())
    assert machine >= 0.9 * spinner - 0.05, (machine, spinner)  # whatever else runs, it is counted too


@pytest.mark.skipif(CORES < 2, reason="one core leaves nothing to share")
def test_the_count_drops_beside_busy_processes_and_comes_back_when_they_stop():
    """The load is read from this test's own processes (their /proc/PID/stat) in place of the whole machine's, so that
    other work beside the test (a busy laptop, the suite's other workers) changes nothing; the decisions are the
    module's own."""
    code = f"""
        import json, os, subprocess, sys, time
        import torch
        from lorarl.trainer import threads

        def cpu_s(pid):
            with open(f"/proc/{{pid}}/stat") as stat:
                ticks = stat.read().rsplit(")", 1)[1].split()
            return (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")

        others, ended = [], {{}}
        def busy_s(cpus):  # this process and the spinners (those that ended: their last reading)
            return time.process_time() + sum(ended.get(p.pid) or cpu_s(p.pid) for p in others)

        threads.machine_busy_s = busy_s
        chosen = threads.configure()
        assert chosen.count == {CORES}, chosen.count

        def compute(seconds):
            a = torch.randn(256, 256)
            decisions, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end:
                with threads.busy():
                    for _ in range(20):
                        a = torch.mm(a, a) / 256
                decisions.append((torch.get_num_threads(), chosen.others))
            return decisions

        others.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range({CORES}))
        try:
            time.sleep(0.5)
            loaded = compute(3.0)
        finally:
            for p in others:
                ended[p.pid] = cpu_s(p.pid)
                p.kill()
                p.wait()
        quiet = compute(3.0)
        print(json.dumps({{"loaded": loaded, "quiet": quiet}}))
    """
    runs = json.loads(run_python(code))
    for count, others in runs["loaded"] + runs["quiet"]:
        assert count == threads_for(CORES, others), runs  # each decision: the cores the others left idle
    count, others = runs["loaded"][-1]
    assert others > 0.25, runs  # spinners on every core: their load was seen
    assert count < CORES, runs  # and fewer threads taken
    assert runs["quiet"][-1] == [CORES, 0.0], runs  # they stopped: every core again


def test_a_count_set_by_the_user_is_kept_whatever_the_load():
    code = """
        import torch
        from lorarl.trainer import threads

        chosen = threads.configure(%s)
        with threads.busy():
            pass
        print(torch.get_num_threads(), chosen.adaptive, chosen.describe())
    """
    assert run_python(code % "3") == f"3 False threads: 3 (trainer.threads; {CORES} cores available)"
    assert run_python(code % "None", OMP_NUM_THREADS="1").startswith("1 False threads: 1 (OMP_NUM_THREADS;")


def test_the_trainer_prints_its_threads_once_and_logs_them_each_step(tiny_setup, tmp_path):
    out = tmp_path / "out"
    overrides = tiny_overrides(tiny_setup, out, trainer__steps=2, trainer__threads=1)
    done = subprocess.run([sys.executable, "-m", "lorarl.trainer.cli", *overrides], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("threads:")]
    assert lines == [f"threads: 1 (trainer.threads; {CORES} cores available)"], done.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["threads"] for s in steps] == [1, 1]
