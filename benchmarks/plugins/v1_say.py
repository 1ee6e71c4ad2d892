"""The verifiers v1 taskset `benchmarks/verifiers_v1_overhead.py` plays: one task a number, "<i>*7", scored by
whether the reply holds 7 (what the embedded calculator model's tokenizer writes: digits, operators, its tags)."""

import verifiers.v1 as vf

REPLY = "7"


class SayData(vf.TaskData):
    answer: str


class SayTask(vf.Task[SayData]):
    @vf.reward(weight=1.0)
    async def said(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))


class SayTaskset(vf.Taskset[SayTask, vf.TasksetConfig]):
    def load(self):
        for i in range(1 << 10):
            yield SayTask(SayData(idx=i, prompt=f"{i}*7", answer=REPLY), self.config.task)


__all__ = ["SayTaskset"]
