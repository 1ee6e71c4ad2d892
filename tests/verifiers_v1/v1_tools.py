"""A v1 taskset whose task has a toolset of one tool (served by verifiers as an MCP server: this module, run with
`python -m`) and two weighted rewards."""

import verifiers.v1 as vf


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first term
            b: the second term
        """
        return str(a + b)


class SumData(vf.TaskData):
    answer: str


class SumTaskConfig(vf.TaskConfig):
    calc: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [CalcTools(config.calc)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class SumTasksetConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        for i, (a, b) in enumerate(((2, 3), (10, 7))):
            yield SumTask(SumData(idx=i, prompt=f"{a}+{b}=?", answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]

if __name__ == "__main__":
    CalcTools.run()
