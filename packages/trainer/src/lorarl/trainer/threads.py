"""CPU threads sized to the cores a process can have, and re-sized while other work comes and goes.

Why: torch runs its CPU kernels in OpenMP parallel regions, each closed by a barrier where every thread waits for the
slowest. On a machine whose cores are busy with other work, a thread the scheduler has set aside holds the barrier
until it runs again, while the others spin in it. Beside two 2-thread torch loops on 2 cores, 60% of the trainer's CPU
time was libgomp's spin loop, and a step took 14-57x its quiet time, where a fair share of the cores costs 3x. One
thread has no barrier to wait at. So a process takes the cores the rest of the machine leaves idle, never more than
its affinity and cgroup quota allow. It measures the others' CPU use while it computes itself (`busy()`): the work of
a second lorarl process that alternates with this one (an engine worker generating while the trainer waits for it)
is not load, and the same work beside it (`rollout.overlap`) is.

A fixed count (`trainer.threads`, or `OMP_NUM_THREADS` / `MKL_NUM_THREADS` in the environment) is kept as it is.
Results depend on the count only through reductions large enough for torch to split across threads (a sum over
more than 32768 elements, such as the gradient norm of a large weight): fixing the count repeats a run bit for bit
whatever else the machine does.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

WINDOW_S = 0.25  # busy wall time a decision is made from: /proc/stat counts in 10 ms ticks
SLACK = 0.25  # a core the others leave 75% idle counts as free
FIXING_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota (a container's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cores, round(quota))) if quota is not None else cores


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota (cores) of this process's cgroup and those above it, the tightest; None: no quota. cgroup v2
    (`cpu.max`: "max 100000" or "150000 100000") or v1 (`cpu.cfs_quota_us`, -1 for none, over `cpu.cfs_period_us`)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy; a limit on any ancestor applies
            directory = root / path.lstrip("/")
            while True:
                quotas.append(_v2_quota(directory / "cpu.max"))
                if directory == root or root not in directory.parents:
                    break
                directory = directory.parent
        elif "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                quotas.append(_v1_quota(mount / path.lstrip("/")))
                quotas.append(_v1_quota(mount))  # a container sees its own cgroup at the mount's root
    known = [q for q in quotas if q is not None]
    return min(known) if known else None


def _v2_quota(file: Path) -> float | None:
    try:
        quota, period = file.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def machine_busy_s(cpus: frozenset[int]) -> float:
    """CPU seconds the machine has spent busy on `cpus` since boot (/proc/stat: user, nice, system, irq, softirq and
    steal time; what a hypervisor gave another machine is not ours to use either)."""
    busy = 0
    with open("/proc/stat") as stat:
        for line in stat:
            if not line.startswith("cpu"):
                break
            name, *ticks = line.split()
            if name != "cpu" and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, ticks[:8])
                busy += user + nice + system + irq + softirq + steal
    return busy / _TICKS_PER_S


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_for(cores: int, others: float) -> int:
    """Threads for a process that may use `cores` while other work keeps `others` cores busy: the cores left idle
    (at least one)."""
    return max(1, min(cores, math.floor(cores - others + SLACK)))


@dataclass
class _Window:
    """What a decision reads: wall time spent busy, the machine's busy CPU time and this process's in it."""

    wall: float = 0.0
    machine: float = 0.0
    own: float = 0.0


class Threads:
    """This process's torch CPU threads: fixed, or adapted to the load at the start of each busy section once a
    window of busy time has been seen (`busy()`; the time since `configure` counts as the first)."""

    def __init__(self, fixed: int | None, source: str, key: str = "trainer.threads"):
        self.cores = available_cores()
        self.fixed, self.source, self.key = fixed, source, key  # key: the setting that fixes the count
        self.adaptive = fixed is None and hasattr(os, "sched_getaffinity") and Path("/proc/stat").is_file()
        self.cpus = frozenset(os.sched_getaffinity(0)) if self.adaptive else frozenset()
        self.count = fixed or self.cores
        self.others = 0.0  # cores the other work kept busy, at the last decision
        self.window = _Window()
        self.depth = 0
        self.opened = self._now() if self.adaptive else None  # the open section's start: (wall, machine, own)
        _set_torch_threads(self.count)

    def describe(self) -> str:
        if self.fixed is not None:
            return f"threads: {self.count} ({self.source}; {self.cores} cores available)"
        how = "fewer while other work keeps them busy" if self.adaptive else "this system reports no load"
        return f"threads: {self.count} of {self.cores} cores available, {how} ({self.key}=N fixes the count)"

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A section where this process computes: the load beside it is measured, and the count adapted to it."""
        if not self.adaptive:
            yield
            return
        if self.depth == 0:
            self._close()
            if self.window.wall >= WINDOW_S:
                self._decide()
            self.opened = self._now()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._close()

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), machine_busy_s(self.cpus), time.process_time()

    def _close(self) -> None:
        if self.opened is None:
            return
        wall, machine, own = (b - a for a, b in zip(self.opened, self._now(), strict=True))
        self.window.wall += wall
        self.window.machine += machine
        self.window.own += own
        self.opened = None

    def _decide(self) -> None:
        if not _torch_sets_threads():  # an engine took the threads over (vLLM's CPU build binds them to cores)
            self.adaptive = False
            return
        window, self.window = self.window, _Window()
        self.others = max(0.0, window.machine - window.own) / window.wall
        count = threads_for(self.cores, self.others)
        if count != self.count:
            self.count = count
            _set_torch_threads(count)


def _torch_sets_threads() -> bool:
    """Whether `torch.set_num_threads` is torch's own: vLLM's CPU worker replaces it once it has bound its threads."""
    import torch

    return getattr(torch.set_num_threads, "__module__", "").startswith("torch")


def _set_torch_threads(count: int) -> None:
    import torch

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def fix(count: int) -> None:
    """This process's threads fixed at `count`, for the libraries it loads later too (a reward worker: its
    functions may bring their own torch or BLAS)."""
    for name in (*FIXING_VARIABLES, "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(count)
    if "torch" in sys.modules:
        _set_torch_threads(count)


_process: Threads | None = None


def configure(setting: int | None = None, *, key: str = "trainer.threads") -> Threads:
    """This process's threads from now on: `setting` (a count, from the setting `key`), else the environment's fixed
    count, else adapted to the cores and the load."""
    global _process
    fixed = next(((name, os.environ[name]) for name in FIXING_VARIABLES if os.environ.get(name)), None)
    if setting:
        _process = Threads(setting, key, key)
    elif fixed and fixed[1].isdigit() and int(fixed[1]) > 0:
        _process = Threads(int(fixed[1]), fixed[0], key)
    else:
        _process = Threads(None, "auto", key)
    return _process


@contextmanager
def busy() -> Iterator[None]:
    """`Threads.busy` of this process's threads, when configured (a library caller's own process: nothing)."""
    if _process is None:
        yield
    else:
        with _process.busy():
            yield


def current() -> int:
    """The torch CPU threads of this process now."""
    import torch

    return torch.get_num_threads()
