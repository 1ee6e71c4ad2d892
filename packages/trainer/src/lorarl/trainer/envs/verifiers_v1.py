"""verifiers v1 environments (verifiers >= 0.4: `Taskset`, `Task`, `Harness`, `Toolset`), unchanged, trained on
exactly the tokens lorarl's engine sampled.

A v1 episode is verifiers' own: `Env.run_episode(task, ctx)` runs the harness (a program of its own) against
verifiers' interception server, whose train client renders each chat request to token ids (the `renderers` package,
reusing the tokens of earlier turns) and asks an inference server's token-in/token-out route for the completion. Here
that route is lorarl's (`EngineRoute`: `POST /ep/<episode>/inference/v1/generate`, on loopback, on the episodes'
loop): each request becomes the episode's next observation — its token ids — and its answer is the action lorarl's
engine sampled (ids and log-probs), so the episode is played, batched and bounded like any other. Once it has ended,
each trainable branch verifiers recorded is checked against lorarl's record of the episode (`conclude`): token ids,
which were sampled, and their log-probs; a branch that differs is refused, naming the episode.

`env.verifiers.id` names the taskset (an installed id, or an importable module exporting one `Taskset`);
`env.verifiers.args` are its config's fields; `env.verifiers.config` the rest of verifiers' env config (`agent`:
`harness`, `runtime`, `max_turns`, ...). The runtime defaults to a local subprocess, and the harness to the taskset's
own or else verifiers' plain chat loop (`null`: `bash` would compact histories). A data row is a task's data
(`TaskData` fields: `prompt`, `answer`, `info`, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import re

from lorarl.trainer.envs.base import Action, Environment, Observation, Step
from lorarl.trainer.errors import TrainerError

try:
    import verifiers.v1 as vf
    from aiohttp import web
except ImportError:
    raise TrainerError("env=verifiers with verifiers >= 0.4 (its v1 stack) needs its environment: "
                       "scripts/vllm_cpu_env.sh --verifiers-v1") from None  # fmt: skip

KEY_VAR = "LORARL_VERIFIERS_KEY"  # verifiers' client reads its API key from a variable; lorarl's route takes any


@functools.cache
def load(settings: str) -> vf.Env:
    """The v1 environment `env.verifiers.*` (JSON) describes; each of its seats (`agent`, or an `Env`'s own) runs
    in a local subprocess, with the taskset's harness or else `null`, unless configured."""
    s = json.loads(settings)
    raw = {**s["config"], "taskset": {"id": s["id"], **s["args"]}}
    plain = vf.default_agent_harness(s["id"]).id == "bash"
    try:
        for name, value in vf.resolve_env_config(raw):
            if isinstance(value, vf.AgentConfig):
                seat = dict(raw.get(name) or {})
                seat.setdefault("runtime", {"type": "subprocess"})
                if plain:
                    seat.setdefault("harness", {"id": "null"})
                raw[name] = seat
        return vf.load_environment(vf.resolve_env_config(raw))
    except Exception as e:
        raise TrainerError(f"env.verifiers.id={s['id']!r}: cannot load the v1 environment: "
                           f"{type(e).__name__}: {e}") from None  # fmt: skip


class EngineRoute:
    """lorarl's engine as an inference server's token-in/token-out route, for the episodes of one event loop."""

    def __init__(self):
        self.episodes: dict[int, VerifiersV1Environment] = {}
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/ep/{key}/inference/v1/generate", self.generate)
        app.router.add_get("/ep/{key}/v1/models", self.models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def generate(self, request: web.Request) -> web.Response:
        episode = self.episodes.get(int(request.match_info["key"]))
        if episode is None:
            return web.json_response({"error": {"message": "no such episode (it has ended)"}}, status=400)
        return web.json_response(await episode.asked(await request.json()))

    async def models(self, request: web.Request) -> web.Response:
        episode = self.episodes.get(int(request.match_info["key"]))
        return web.json_response({"data": [{"id": episode.model if episode else "lorarl", "max_model_len": None}]})


_routes: dict[asyncio.AbstractEventLoop, tuple[EngineRoute, contextlib.AsyncExitStack]] = {}


async def _route(environment: vf.Env) -> EngineRoute:
    """This loop's route, with the environment serving (its interception server and shared tool servers) beside it."""
    loop = asyncio.get_running_loop()
    if loop not in _routes:
        route, stack = EngineRoute(), contextlib.AsyncExitStack()
        await route.start()
        await stack.enter_async_context(environment.serving())
        _routes[loop] = (route, stack)
    return _routes[loop][0]


_TRACEBACK_LINE = re.compile(r'^(Traceback \(most recent call last\):|File ".*", line \d+|\^+$)')
_RAISED_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Group)\b")


def _condensed(message: str) -> str:
    """An error's message; one that carries a Python traceback (a harness's stderr tail, where a tool server
    failed) cut to its first line and the last exception it names."""
    lines = [line.strip(" |+-") for line in message.splitlines()]
    if not any(_TRACEBACK_LINE.match(line) for line in lines):
        return message
    raised = [line for line in lines[1:] if _RAISED_LINE.match(line)]
    return f"{lines[0]} ... {raised[-1]}" if raised else lines[0]


class VerifiersV1Environment(Environment):
    """One v1 episode: verifiers' program, its model calls answered by lorarl's engine."""

    steps_truncated = True  # the program hears of a cut action (finish_reason length), as from vLLM
    keys = itertools.count()
    model = "lorarl"

    @property
    def environment(self) -> vf.Env:
        s = self.settings
        return load(json.dumps({"id": s.id, "args": dict(s.args), "config": dict(s.config)}, sort_keys=True))

    @property
    def renderer(self) -> dict:
        return {"name": "default", **self.settings.renderer}

    async def reset(self, example) -> Observation:
        environment = self.environment
        task_type = type(environment.taskset).task_type()
        row = example.row() if example.answer is None else {"answer": example.answer, **example.row()}
        try:
            task = task_type(task_type.data_type().model_validate(row), environment.config.taskset.task)
        except Exception as e:
            raise TrainerError(f"{example.where}: not a task of env.verifiers.id={self.settings.id!r}: "
                               f"{type(e).__name__}: {e}") from None  # fmt: skip
        self.route = await _route(environment)
        self.key = next(self.keys)
        self.route.episodes[self.key] = self
        self.requests: asyncio.Queue = asyncio.Queue()
        self.answered = 0
        # the engine samples with rollout.*, each turn within what is left of env.max_tokens: the request's own
        # sampling settings are not read
        ctx = vf.ModelContext(model=self.model, client=vf.TrainClientConfig(
            base_url=f"{self.route.url}/ep/{self.key}/v1", api_key_var=KEY_VAR,
            renderer=self.renderer, renderer_model_name=self.tokenizer.name_or_path),
            sampling=vf.SamplingConfig(max_tokens=self.setup.section.max_tokens))  # fmt: skip
        self.program = asyncio.ensure_future(environment.run_episode(task, ctx))
        observation = await self._next()
        if observation is None:
            raise TrainerError(f"its program ended before asking the model: {self._errors()}")
        return observation

    async def asked(self, body: dict) -> dict:
        """A request of the program (its train client's): the episode's next observation, answered by its step."""
        future = asyncio.get_running_loop().create_future()
        await self.requests.put((body, future))
        return await future

    async def _next(self) -> Observation | None:
        """The program's next request as an observation, or None once it has ended."""
        waiting = asyncio.ensure_future(self.requests.get())
        try:
            await asyncio.wait([waiting, self.program], return_when=asyncio.FIRST_COMPLETED)
        finally:  # ended, or given up on (env.timeout_s)
            asked = waiting.done()
            if not asked:
                waiting.cancel()
        if not asked:
            return None
        self.body, self.reply = waiting.result()
        stops = self.body.get("sampling_params", {}).get("stop_token_ids") or []
        stop = tuple(self.tokenizer.decode([i]) for i in stops if i != self.tokenizer.eos_token_id)
        return Observation(tuple(self.body["token_ids"]), stop)

    async def step(self, action: Action) -> Step:
        self.reply.set_result({"request_id": f"lorarl-{self.key}-{self.answered}", "choices": [{
            "index": 0, "token_ids": list(action.tokens), "finish_reason": "stop" if action.finished else "length",
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": p}
                                     for t, p in zip(action.tokens, action.logprobs, strict=True)]}}]})  # fmt: skip
        self.answered += 1
        observation = await self._next()
        if observation is not None:
            return Step(observation=observation)
        self.route.episodes.pop(self.key, None)
        trace = self._trace()
        metrics = {name: r.score for name, r in trace.rewards.items() if r is not None}
        metrics.update({name: v for name, v in trace.metrics.items() if v is not None})
        return Step(reward=trace.reward, done=True, stop_reason=trace.stop_condition or "done", metrics=metrics)

    def _trace(self):
        episode = self.program.result()
        trainable = [t for t in episode.traces if t.agent.trainable]
        if not episode.ok:
            raise TrainerError(f"its program failed: {self._errors()}")
        if len(trainable) != 1:
            raise TrainerError(f"its episode has {len(trainable)} trainable traces; lorarl trains episodes of one")
        return trainable[0]

    def _errors(self) -> str:
        """What the program failed with, on one line (a tool server's error carries its log's tail)."""
        text = ""
        if self.program.done() and self.program.exception() is not None:
            text = f"{type(self.program.exception()).__name__}: {self.program.exception()}"
        elif self.program.done():
            episode = self.program.result()
            errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
            text = "; ".join(f"{e.type}: {_condensed(e.message)}" for e in errors)
        return " ".join(text.split()) or "no error"

    @classmethod
    def conclude(cls, groups: list[list]) -> None:
        """Each finished episode's trainable branches checked against lorarl's record of it; a program lorarl ended
        (a budget, the context, env.max_turns) stopped."""
        for group in groups:
            for episode in group:
                env = episode.env
                if not hasattr(env, "program"):
                    continue
                if not env.program.done():
                    env.program.cancel()
                    env.route.episodes.pop(env.key, None)
                    continue
                if episode.stop_reason in ("error", "timeout"):
                    continue
                check_branches(episode, env._trace())


def check_branches(episode, trace) -> None:
    """Refuse a trace whose trainable branches are not the episode's segments: the same token ids, sampled where
    lorarl sampled them, with its engine's log-probs."""
    branches = [b for b in trace.branches if b.trainable]
    where = episode.example.where or "a data row"
    if len(branches) != len(episode.segments):
        raise TrainerError(f"the v1 episode of {where}: verifiers recorded {len(branches)} trainable branches where "
                           f"lorarl played {len(episode.segments)} sequences")  # fmt: skip
    for index, (branch, segment) in enumerate(zip(branches, episode.segments, strict=True)):
        start = len(segment.prompt)
        own = slice(start, start + len(segment.tokens))
        same = (list(branch.token_ids) == [*segment.prompt, *segment.tokens]
                and list(branch.sampled_mask[own]) == segment.mask
                and all(abs(a - b) < 1e-6 for a, b in zip(branch.logprobs[own], segment.logprobs, strict=True)))
        if not same:
            raise TrainerError(f"the v1 episode of {where}: verifiers' branch {index} is not the tokens lorarl's "
                               "engine sampled (token ids, sampled mask or log-probs differ)")  # fmt: skip
