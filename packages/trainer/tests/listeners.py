"""What a run listens on: every TCP listener of its processes, read from the kernel (/proc/net/tcp{,6} and each
process's sockets) while the run goes on — a command's processes (`run_and_watch`), or this process's own and its
descendants' during a run in it (`watching`)."""

import ipaddress
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


def listeners_under(root: int, *, skip_root: bool = False) -> set[tuple[str, str]]:
    """What `listeners_of` finds held now by `root` and its descendants (`skip_root`: by its descendants alone)."""
    return listeners_of(descendants(root) - ({root} if skip_root else set()), listening_sockets())


def run_and_watch(command: list[str], *, skip_root: bool = False) -> tuple[set[tuple[str, str]], str]:
    """The listeners the command's processes held while it ran (`skip_root`: the depth-0 process, torchrun's agent,
    left out: its own store is torch's), and what it printed (stdout and stderr); it must succeed."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # fmt: skip
        seen = set()
        while process.poll() is None:
            seen |= listeners_under(process.pid, skip_root=skip_root)
            time.sleep(0.1)
        log.seek(0)
        output = log.read()
    assert process.returncode == 0, output[-4000:]
    return seen, output


@contextmanager
def watching() -> Iterator[set[tuple[str, str]]]:
    """The listeners this process and its descendants (a local Ray cluster it started, its engines' processes) held
    while the block ran, gathered into the set it yields."""
    seen: set[tuple[str, str]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(listeners_under(os.getpid()))
            done.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


def on_loopback_alone(seen: set[tuple[str, str]], expected: set[str]) -> bool:
    """The processes named `expected` were seen listening, and every listener seen was on loopback."""
    return expected <= {name for name, _ in seen} and all(is_loopback(address) for _, address in seen)

