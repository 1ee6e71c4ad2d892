"""Environments played in worker processes by test_env_processes (a module of its own: test modules import under
pytest's own names, which a spawned worker cannot import)."""

import os
import time

from test_agentic_rollouts import Turns

from lorarl.trainer.envs.base import Step

MEETING_ENV, TRAINER_PID_ENV, EXIT_ENV = "LORARL_TEST_MEETING", "LORARL_TEST_TRAINER_PID", "LORARL_TEST_EXIT"


class MeetAcrossWorkers(Turns):
    """Each step runs in a worker (not the trainer's process), and waits until steps of two worker processes are
    going on at once: it passes only if the workers' calls run in parallel."""

    def step(self, action) -> Step:
        assert os.getpid() != int(os.environ[TRAINER_PID_ENV])
        meeting = os.environ[MEETING_ENV]
        open(os.path.join(meeting, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 30
        while len(os.listdir(meeting)) < 2:
            assert time.monotonic() < deadline, "the steps of the two workers did not run at once"
            time.sleep(0.01)
        return self.answered(action)


class Exiting(Turns):
    """A step that takes its worker process down (exit code 3, a native crash's likeness) where LORARL_TEST_EXIT=1."""

    def step(self, action) -> Step:
        if os.environ.get(EXIT_ENV) == "1":
            os._exit(3)
        return self.answered(action)
