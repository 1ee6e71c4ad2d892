"""letter-count: say how many letters a word has. The task's own stop condition ends the episode at the first reply that
holds a number, and its reward is graded by the distance to the right count."""

import verifiers.v1 as vf

SYSTEM = "Count the letters of the word. Answer with the number alone."
WORDS = ("cat", "tree", "apple", "go", "planet", "a")


class LetterCountData(vf.TaskData):
    answer: str


class LetterCountTask(vf.Task[LetterCountData]):
    @vf.stop
    async def answered(self, response: vf.Response) -> bool:
        """A reply with a number in it is the answer: the model is not asked again."""
        return any(c.isdigit() for c in response.message.content or "")

    @vf.reward(weight=1.0)
    async def closeness(self, trace: vf.Trace) -> float:
        """1 for the right count, 1/(1 + d) for a count d away, 0 for a reply without a number."""
        digits = "".join(c for c in trace.last_reply or "" if c.isdigit())
        return 1.0 / (1 + abs(int(digits) - int(self.data.answer))) if digits else 0.0


class LetterCountTaskset(vf.Taskset[LetterCountTask, vf.TasksetConfig]):
    def load(self):
        for i, word in enumerate(WORDS):
            data = LetterCountData(idx=i, prompt=word, system_prompt=SYSTEM, answer=str(len(word)))
            yield LetterCountTask(data, self.config.task)
