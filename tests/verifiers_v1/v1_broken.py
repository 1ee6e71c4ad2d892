"""A v1 taskset whose harness crashes before asking the model (prompt "crash") or never answers (prompt "hang")."""

import asyncio

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData]):
    pass


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        yield EchoTask(EchoData(idx=0, prompt="crash"), self.config.task)


class BrokenHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        if data.prompt == "hang":
            await asyncio.sleep(3600)
        raise RuntimeError("the harness crashed")


__all__ = ["BrokenHarness", "EchoTaskset"]
