"""v1_tools' task, but its tool server does not start: this module, run with `python -m` as verifiers serves a
toolset, exits at once."""

import verifiers.v1 as vf
from v1_tools import CalcTools, SumTask, SumTaskConfig, SumTasksetConfig


class DeadTools(CalcTools):
    pass


class DeadSumTask(SumTask):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [DeadTools(config.calc)]


class DeadSumTaskset(vf.Taskset[DeadSumTask, SumTasksetConfig]):
    def load(self):
        return iter(())


__all__ = ["DeadSumTaskset"]

if __name__ == "__main__":
    raise SystemExit("this tool server does not start")
