"""A multi-turn v1 environment with feedback: the model guesses, the environment answers "Wrong, try again." until
the guess holds the answer (at most 3 tries)."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: str


class GuessTask(vf.Task[GuessData]):
    pass


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for i, word in enumerate(("hi", "yo")):
            yield GuessTask(GuessData(idx=i, prompt="Guess the word", answer=word), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents) -> None:
        tries = 0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            tries += 1
            while not segment.terminated and task.data.answer not in (segment.last_reply or "") and tries < 3:
                segment = await interaction.turn("Wrong, try again.")
                tries += 1
        solved = task.data.answer in (segment.last_reply or "")
        interaction.trace.record_reward("solved", float(solved), 1.0)
        interaction.trace.record_reward("quick", float(solved) / tries, 0.5)


__all__ = ["GuessEnv", "GuessTaskset"]
