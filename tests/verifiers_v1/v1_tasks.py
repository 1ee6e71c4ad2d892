"""verifiers v1 tasksets of the tests (written with verifiers' own classes): a task the model answers in one reply,
scored by two weighted rewards."""

import verifiers.v1 as vf


class GreetData(vf.TaskData):
    answer: str


class GreetTask(vf.Task[GreetData]):
    @vf.reward(weight=1.0)
    async def said(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") <= 8)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class GreetTaskset(vf.Taskset[GreetTask, vf.TasksetConfig]):
    def load(self):
        for i, word in enumerate(("hi", "yo", "hey", "ok")):
            yield GreetTask(GreetData(idx=i, prompt=f"Say {word}", answer=word), self.config.task)


__all__ = ["GreetTaskset"]
