"""Runs whose processes are all on this machine listen on loopback alone: the rollout engine's process and the
weight-sync group's rendezvous, a local Ray cluster (its GCS, raylet and workers) with engine replicas or trainer
ranks, and torchrun's ranks on one node. Every TCP listener of the run's processes is read from the kernel
(/proc/net/tcp{,6} and each process's sockets) while the run goes on."""

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_fixtures import tiny_overrides

LISTEN = "0A"


def listening_sockets() -> dict[int, str]:
    """Every TCP socket listening on this machine: its inode and local address."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address = bytes.fromhex(fields[1].split(":")[0])
            # the kernel writes each 32-bit word of the address in the host's (little-endian) byte order
            words = b"".join(address[i : i + 4][::-1] for i in range(0, len(address), 4))
            found[int(fields[9])] = str(ipaddress.ip_address(words))
    return found


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def listeners_of(pids: set[int], sockets: dict[int, str]) -> set[tuple[str, str]]:
    """(process name, address) of each socket in `sockets` that a process of `pids` holds."""
    held = set()
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and int(target[8:-1]) in sockets:
                    held.add((name, sockets[int(target[8:-1])]))
        except OSError:  # it ended meanwhile
            continue
    return held


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def run_and_watch(command: list[str], *, skip: int | None = None) -> set[tuple[str, str]]:
    """The listeners the command's processes held while it ran (`skip`: the depth-0 process, torchrun's agent, left
    out: its own store is torch's)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # fmt: skip
    seen = set()
    while process.poll() is None:
        pids = descendants(process.pid) - ({process.pid} if skip else set())
        seen |= listeners_of(pids, listening_sockets())
        time.sleep(0.1)
    output = process.stdout.read()
    assert process.returncode == 0, output[-4000:]
    return seen


def trainer(setup, out, **extra) -> list[str]:
    return [sys.executable, "-m", "lorarl.trainer.cli", *tiny_overrides(setup, out, trainer__steps=3, **extra)]


PLACEMENTS = {
    "process-engine": ({"rollout__worker": "process"}, {"python"}),
    "ray-replicas": ({"trainer__backend": "ray", "rollout__replicas": 2}, {"gcs_server", "raylet"}),
    "ray-trainer-ranks": ({"trainer__backend": "ray", "trainer__n_gpus_per_node": 2}, {"gcs_server", "raylet"}),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_run_on_this_machine_listens_on_loopback_alone(tiny_setup, tmp_path, placement):
    extra, expected = PLACEMENTS[placement]
    seen = run_and_watch(trainer(tiny_setup, tmp_path / "out", **extra))
    assert expected <= {name for name, _ in seen}, seen  # the run's listeners were seen
    assert all(is_loopback(address) for _, address in seen), seen


def test_torchrun_ranks_on_one_node_listen_on_loopback_alone(tiny_setup, tmp_path):
    """torchrun's agent hosts the rendezvous store (torch's, on every interface: name the node's address in
    --rdzv-endpoint and a firewall for it); the ranks, lorarl's, listen on loopback."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "lorarl.trainer.cli", *tiny_overrides(tiny_setup, tmp_path / "out", trainer__steps=2)]  # fmt: skip
    seen = run_and_watch(command, skip=True)
    assert seen, "no listener of the ranks was seen"
    assert all(is_loopback(address) for _, address in seen), seen
