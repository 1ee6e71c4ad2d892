"""A v1 taskset whose harness is verifiers' chat loop, but crashes before asking the model on the prompt "crash" and
never answers on the prompt "hang"."""

import asyncio

import verifiers.v1 as vf
from verifiers.v1.harnesses.null.harness import NullHarness


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def replied(self, trace: vf.Trace) -> float:
        return float(bool(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        yield EchoTask(EchoData(idx=0, prompt="crash"), self.config.task)


class BrokenHarness(NullHarness):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> vf.ProgramResult:
        if data.prompt == "hang":
            await asyncio.sleep(3600)
        if data.prompt == "crash":
            raise RuntimeError("the harness crashed")
        return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs)


__all__ = ["BrokenHarness", "EchoTaskset"]
