"""The run's reward (`Rewards`): its functions' scores, weighted, and the failures it tolerates; with
`reward.workers`, scored in worker processes (`ScoringPool`): slow reward functions (code execution, a judge) in
parallel, each call stopped after `reward.timeout_s`."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lorarl.trainer import threads
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.rewards import Response, Reward, RewardError, call, load_reward, reads_answer, style
from lorarl.trainer.schema import RewardSection


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
        cores = max(1, threads.available_cores() // self.workers)  # the workers share the cores, never oversubscribed
        self.executor = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_load_in_worker,
                                            initargs=(self.specs, self.options, cores))  # fmt: skip
        for future in [self.executor.submit(int) for _ in range(self.workers)]:
            future.result()  # started and loaded: the time limits below are the calls' own

    def score(self, index: int, responses: Sequence[Response], trainer_state=None) -> list[float | RewardError | None]:
        """Each response's score, or the error of its call (`trainer_state`: a TRL reward's). A worker that dies
        (killed, crashed) breaks the pool: every response it had not scored yet fails, and a fresh pool scores the
        next call."""
        from concurrent.futures import wait
        from concurrent.futures.process import BrokenProcessPool

        if self.executor is None:
            self._start()
        futures = [self.executor.submit(_score_in_worker, index, response, self.timeout, trainer_state)
                   for response in responses]  # fmt: skip
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


def _load_in_worker(specs: list[str], options: list[dict], cores: int) -> None:
    from lorarl.trainer.interrupt import ignore_stop_signals

    ignore_stop_signals()
    threads.fix(cores)  # before the reward functions load what they use
    _WORKER_FNS[:] = [(load_reward(spec), chosen) for spec, chosen in zip(specs, options, strict=True)]


def _score_in_worker(index: int, response: Response, timeout: float,
                     trainer_state=None) -> float | tuple[str, str] | None:  # fmt: skip
    """A score, None, or ("error", what happened): an exception holding the response would not pickle back."""
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"timed out after {timeout} s")

    if timeout:
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        fn, options = _WORKER_FNS[index]
        if trainer_state is not None:
            options = {**options, "trainer_state": trainer_state}
        return call(fn, [response], options)[0]
    except RewardError as e:
        return ("error", e.problem)
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)


@dataclass(frozen=True)
class Score:
    total: float  # the weighted sum of the parts (None: no score from that function, counted 0)
    parts: tuple[float | None, ...]  # each function's score
    errors: int = 0  # calls that failed and were scored reward.error_score


class Rewards:
    """The run's reward: the weighted sum of its functions' scores (a None counts 0, as in TRL), each function's mean
    logged as `reward/fn/<name>` when there are several. A failure raises — or, with `reward.on_error=score`, scores
    `reward.error_score`, counted in `reward/errors`. With `reward.workers`, a pool of processes scores the
    responses, each call stopped after `reward.timeout_s`."""

    def __init__(self, section: RewardSection, max_steps: int = 0):
        specs = list(section.fns) or [section.fn]
        weights = list(section.weights) or [1.0] * len(specs)  # (one per function: checked with the config)
        self.specs, self.weights, self.section, self.max_steps = specs, weights, section, max_steps
        self.fns = [load_reward(spec) for spec in specs]
        self.options = [fn.configured(section) for fn in self.fns]
        self.names = [fn.name for fn in self.fns]
        self.trl = [style(fn) == "trl" for fn in self.fns]  # TRL's format: also the trainer's state and log_metric
        self.at_step(1)  # before the first step (a validation at step 0): no update done
        self.logged: dict[str, list[float]] = {}  # TRL's log_metric, since the last `metrics`
        self.pool = None
        if section.workers:
            self.pool = ScoringPool(specs, self.options, section.workers, section.timeout_s)

    def check_answers(self, examples: Sequence) -> None:
        """Refuse data without an answer where a reward function takes one as an argument (`data.Example`s)."""
        from lorarl.trainer.data import AUTO_ANSWER, without_answer

        missing = without_answer(examples)
        reading = [spec for spec, fn in zip(self.specs, self.fns, strict=True) if reads_answer(fn)]
        if missing is not None and reading:
            keys = ", ".join(map(repr, AUTO_ANSWER))
            raise TrainerError(f"{missing.where}: no answer ({keys}; it has {sorted(missing.columns)}), which "
                               f"reward.fn={reading[0]!r} takes: set data.answer_key, or use a reward that reads the "
                               "columns it names (TRL's format), or reward.fn=none (an environment's own reward "
                               "alone)")  # fmt: skip

    def at_step(self, step: int) -> None:
        """The responses scored next are the rollouts of `step` (TRL's `trainer_state`: `step - 1` updates done)."""
        from transformers import TrainerState

        self.trainer_state = TrainerState(global_step=step - 1, max_steps=self.max_steps)

    def log_metric(self, name: str, value: float) -> None:
        self.logged.setdefault(name, []).append(float(value))

    def score(self, responses: Sequence[Response]) -> list[Score]:
        """Each response's reward and its functions' parts."""
        parts: list[list[float | None]] = [[] for _ in responses]
        errors = [0] * len(responses)
        for index, fn in enumerate(self.fns):
            options = self.options[index]
            if self.trl[index]:
                options = {**options, "trainer_state": self.trainer_state, "log_metric": self.log_metric}
            if self.pool is not None:
                results = self.pool.score(index, responses, self.trainer_state if self.trl[index] else None)
            elif self.section.on_error == "raise":
                results = call(fn, responses, options)
            else:  # one call per response, so that one failure leaves the others scored
                results = [_caught(fn, response, options) for response in responses]
            for i, result in enumerate(results):
                if isinstance(result, RewardError):
                    if self.section.on_error == "raise":
                        raise result
                    errors[i] += 1
                    result = self.section.error_score
                parts[i].append(result)
        return [Score(sum(w * p for w, p in zip(self.weights, ps, strict=True) if p is not None), tuple(ps), e)
                for ps, e in zip(parts, errors, strict=True)]  # fmt: skip

    def metrics(self, scores: Sequence[Score]) -> dict:
        """Each function's mean over the responses it scored (with several functions), and the failed calls."""
        metrics = {}
        if len(self.fns) > 1:
            for index, name in enumerate(self.names):
                given = [s.parts[index] for s in scores if s.parts[index] is not None]
                if given:
                    metrics[f"reward/fn/{name}"] = sum(given) / len(given)
        errors = sum(s.errors for s in scores)
        if errors:
            metrics["reward/errors"] = errors
        metrics.update({name: sum(values) / len(values) for name, values in self.logged.items()})
        self.logged = {}
        return metrics

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _caught(fn: Callable, response: Response, options: dict) -> float | RewardError | None:
    try:
        return call(fn, [response], options)[0]
    except RewardError as e:
        return e
