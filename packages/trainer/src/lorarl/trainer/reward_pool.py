"""Scoring in worker processes (`reward.workers`): slow reward functions (code execution, a judge) in parallel, each
call stopped after `reward.timeout_s`."""

from collections.abc import Sequence

from lorarl.trainer.rewards import Response, Reward, RewardError, call, load_reward


class ScoringPool:
    """Processes (spawned: no state forked from the trainer) that load the reward functions once and score one response
    per call, each call stopped by a timer after `timeout` s (0: none). A worker stuck where the timer cannot reach
    (inside C code) is killed with the pool, which starts again; its responses count as timed out."""

    def __init__(self, specs: list[str], options: list[dict], workers: int, timeout: float):
        self.specs, self.options, self.workers, self.timeout = specs, options, workers, timeout
        self.executor = None  # started when first used (only the rank that scores uses it)

    def _start(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")
        self.executor = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_load_in_worker,
                                            initargs=(self.specs, self.options))  # fmt: skip
        for future in [self.executor.submit(int) for _ in range(self.workers)]:
            future.result()  # started and loaded: the time limits below are the calls' own

    def score(self, index: int, responses: Sequence[Response]) -> list[float | RewardError | None]:
        """Each response's score, or the error of its call. A worker that dies (killed, crashed) breaks the pool:
        every response it had not scored yet fails, and a fresh pool scores the next call."""
        from concurrent.futures import wait
        from concurrent.futures.process import BrokenProcessPool

        if self.executor is None:
            self._start()
        futures = [self.executor.submit(_score_in_worker, index, response, self.timeout) for response in responses]
        rounds = -(-len(responses) // self.workers) + 1
        _, stuck = wait(futures, timeout=rounds * self.timeout + 2 if self.timeout else None)
        results, broken = [], False
        for future, response in zip(futures, responses, strict=True):
            if future in stuck:
                results.append(RewardError(f"did not answer within {self.timeout} s (its worker was killed)", response))
                continue
            try:
                value = future.result()
            except BrokenProcessPool:
                broken = True
                results.append(RewardError("did not return: a reward worker process died (killed, or crashed in "
                                           "the reward function)", response))  # fmt: skip
                continue
            results.append(RewardError(value[1], response) if isinstance(value, tuple) else value)
        if stuck or broken:
            self.close()  # started again for the next call
        return results

    def close(self) -> None:
        if self.executor is None:
            return
        for process in list((self.executor._processes or {}).values()):
            process.kill()  # a worker stuck in C code ignores everything else
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.executor = None


_WORKER_FNS: list[tuple[Reward, dict]] = []


def _load_in_worker(specs: list[str], options: list[dict]) -> None:
    from lorarl.trainer.engines.process import ignore_stop_signals

    ignore_stop_signals()
    _WORKER_FNS[:] = [(load_reward(spec), chosen) for spec, chosen in zip(specs, options, strict=True)]


def _score_in_worker(index: int, response: Response, timeout: float) -> float | tuple[str, str] | None:
    """A score, None, or ("error", what happened): an exception holding the response would not pickle back."""
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"timed out after {timeout} s")

    if timeout:
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        fn, options = _WORKER_FNS[index]
        return call(fn, [response], options)[0]
    except RewardError as e:
        return ("error", e.problem)
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
