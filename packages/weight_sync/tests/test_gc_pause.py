"""`gc_paused`: transfers in several threads, nested ones and failing ones leave Python's collector as they found it."""

import gc
import threading

import pytest

from lorarl.weight_sync.gc_pause import gc_paused


def test_the_collector_resumes_once_the_last_of_concurrent_and_nested_pauses_ends():
    assert gc.isenabled()
    started, release = threading.Event(), threading.Event()

    def other_transfer():
        with gc_paused():
            started.set()
            release.wait(10)

    thread = threading.Thread(target=other_transfer)
    with gc_paused():
        thread.start()
        assert started.wait(10)
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's transfer is still running
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_failure_inside_resumes_the_collector_and_one_disabled_before_stays_disabled():
    with pytest.raises(RuntimeError, match="input failed"), gc_paused():
        raise RuntimeError("input failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
