"""Python's cyclic garbage collector paused while a transfer runs.

A transfer of many small tensors allocates tens of thousands of small objects (header entries, tensor specs, views).
Every 700 allocations start a collection, and now and then a full one walks every object of the process: in a
trainer or a rollout engine, every module and parameter too. Objects left in reference cycles meanwhile are collected
once the transfer is over.
"""

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # transfers running now, in any thread
_was_enabled = False  # the collector's state before the first of them


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collections inside (nestable, from several threads); the collector's earlier state afterwards."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
