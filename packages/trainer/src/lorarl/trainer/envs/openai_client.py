"""Episodes played by a program that talks to an OpenAI client, trained on exactly the tokens the engine sampled.

Agent code written against OpenAI's API (a verifiers environment's rollout, an agent loop) asks for a chat completion
with the whole conversation each turn. `ClientEnvironment` plays such a program as an episode. The program is a task on
one event loop, and that loop runs only while lorarl waits for the episode's next request. The program's client is
in-process: an `AsyncOpenAI` whose HTTP transport hands each request to the episode it belongs to.

The episode renders the request through the tokenizer's chat template as the extension of the tokens sampled so far
(`chat.py`). A conversation the program rewrote, or a request with other tools, is rendered whole and starts a new
training sample. The engine samples the request with the rest of the batch. The answer goes back as vLLM's server
gives it: the assistant message, with tool calls parsed in `env.tool_format`; `prompt_token_ids`;
`choices[0].token_ids`; and per-token `logprobs`. These are the engine's own ids and log-probs.

Once an episode has ended, its program is run to its end (`conclude`). A last action cut at a length is answered with
`finish_reason: length`. A request after the episode's end is answered with the context-length error an OpenAI server
gives for a prompt that no longer fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING

import httpx

from lorarl.trainer.envs.base import Action, Observation, Step
from lorarl.trainer.envs.chat import ChatEnvironment, chat_template
from lorarl.trainer.envs.scheduling import event_loop
from lorarl.trainer.envs.tools import TOOL_FORMATS, ParseError, Tool
from lorarl.trainer.errors import TrainerError

if TYPE_CHECKING:
    from lorarl.trainer.envs.episodes import Episode

EPISODE: contextvars.ContextVar[ClientEnvironment] = contextvars.ContextVar("lorarl_client_episode")
OVERLONG = ("This model's maximum context length is reached: the episode's token budget (env.max_tokens) or turns "
            "(env.max_turns) are spent")  # fmt: skip


def error(status: int, message: str, kind: str = "invalid_request_error") -> tuple[int, dict]:
    """An answer in the shape of OpenAI's errors."""
    return status, {"error": {"message": message, "type": kind, "param": None, "code": None}}


class Transport(httpx.AsyncBaseTransport):
    """Hands a chat-completions request to the episode whose program sent it, and returns that episode's answer."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        episode = EPISODE.get(None)
        if episode is None:
            status, body = error(500, "lorarl's in-process client answers the programs of lorarl's episodes only")
        elif request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            status, body = error(404, f"{request.method} {request.url.path}: lorarl's in-process client answers "
                                      "POST /v1/chat/completions only")  # fmt: skip
        else:
            status, body = await episode.exchange(json.loads(request.content))
        return httpx.Response(status, json=body)


@functools.cache
def client():
    """The in-process `AsyncOpenAI` client, shared by every episode (a request goes to the episode of its task)."""
    from openai import AsyncOpenAI

    transport = httpx.AsyncClient(transport=Transport())
    return AsyncOpenAI(api_key="lorarl", base_url="http://lorarl.invalid/v1", max_retries=0, http_client=transport)


def said(messages: list[dict]) -> list[tuple]:
    """What a conversation says, message by message: the part a program's records keep of what it was answered."""
    return [(m.get("role"), m.get("content") or "") for m in messages]


def renderable(message: dict) -> dict:
    """A message as chat templates take it: tool-call arguments as a mapping (OpenAI sends a JSON string)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for c in calls:
        function = dict(c.get("function", {}))
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):  # else rendered as sent
                function["arguments"] = json.loads(function["arguments"])
        parsed.append({**c, "function": function})
    return {**message, "tool_calls": parsed}


class ClientEnvironment(ChatEnvironment):
    """An episode played by `program(example, client)`: a coroutine that asks `client` (an `AsyncOpenAI`) for chat
    completions until it is done, and returns what it made of the episode (`self.result`)."""

    def program(self, example, client) -> Coroutine:
        raise NotImplementedError

    async def reset(self, example) -> Observation:
        loop = asyncio.get_running_loop()
        self.request, self.reply, self.answered, self.messages = loop.create_future(), None, 0, []
        context = contextvars.copy_context()
        context.run(EPISODE.set, self)
        self.task = loop.create_task(self.program(example, client()), context=context)
        body = await self.advance()
        if body is None:
            raise TrainerError(f"{type(self).__name__}: the program ended before asking the model anything "
                               f"(it returned {self.task.result()!r:.200})")  # fmt: skip
        return self.observe(body, None)

    async def step(self, action: Action) -> Step:
        message = self.parse(action)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        self.answer(200, self.completion(action, message, finish))
        self.messages = [*self.messages, message]
        metrics = {"tool_calls": len(message.get("tool_calls", ())), "parse_errors": int("parse_error" in message)}
        body = await self.advance()
        if body is None:
            return Step(done=True, stop_reason=self.outcome(), metrics=metrics)
        return Step(observation=self.observe(body, action), metrics=metrics)

    def outcome(self) -> str:
        """Why the program ended (the episode's stop reason)."""
        return "done"

    def conversation(self, actions: list[Action]) -> tuple[list[dict], list[dict]]:
        """None for reward functions: the program keeps its conversation, and scores it itself."""
        return [], []

    @property
    def result(self):
        """What the program returned (None while it runs, or if it raised)."""
        done = hasattr(self, "task") and self.task.done() and not self.task.cancelled()
        return self.task.result() if done and self.task.exception() is None else None

    @classmethod
    def conclude(cls, groups: list[list[Episode]]) -> None:
        for group in groups:
            for episode in group:
                episode.env.finish(episode)

    def finish(self, episode: Episode) -> None:
        """The program run to its end, once the episode has ended: a last action it was not answered (one cut at a
        length) answered as such, any later request with the context-length error; a program whose environment call
        timed out is cancelled."""
        if not hasattr(self, "task") or self.task.done():
            return
        if episode.stop_reason == "timeout":
            self.task.cancel()
            return
        if len(episode.actions) > self.answered:
            action = episode.actions[-1]
            self.answer(200, self.completion(action, self.parse(action), "length"))
        else:
            self.answer(*error(400, OVERLONG))
        try:
            while event_loop().run_until_complete(self.advance()) is not None:
                self.answer(*error(400, OVERLONG))
        except Exception:  # the program's failure at its end leaves it without a result
            episode.count({"program_errors": 1})

    # the program's side
    async def exchange(self, body: dict) -> tuple[int, dict]:
        """A request from the program: handed to the episode, answered by its next step."""
        if self.request.done():
            return error(400, "one request at a time: an episode's program asked again before it was answered")
        self.reply = asyncio.get_running_loop().create_future()
        self.request.set_result(body)
        return await self.reply

    # the episode's side
    async def advance(self) -> dict | None:
        """Run the program until its next request (returned) or its end (None; what it raised is raised here)."""
        await asyncio.wait((self.request, self.task), return_when=asyncio.FIRST_COMPLETED)
        if self.request.done():
            return self.request.result()
        self.task.result()
        return None

    def answer(self, status: int, body: dict) -> None:
        self.request = self.task.get_loop().create_future()
        self.reply.set_result((status, body))
        self.answered += status == 200

    def observe(self, body: dict, action: Action | None) -> Observation:
        """The context of the request `body`: the episode's context, the sampled `action` and what the template
        appends for the messages after it — or, for a first request, a rewritten conversation or other tools, the
        whole conversation rendered anew (the runner then starts a new training sample)."""
        messages, tools = body.get("messages"), body.get("tools") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TrainerError(f"{type(self).__name__}: a chat completion request needs `messages`, a list of "
                               f"messages with a role, got {messages!r:.200}")  # fmt: skip
        template = chat_template(self.tokenizer, json.dumps(tools))
        recorded = said(self.messages)
        if action is not None and template is self.template and said(messages[: len(recorded)]) == recorded:
            appended = [renderable(m) for m in messages[len(recorded) :]]
            self.context = self.context + action.tokens + template.continuation(action, appended)
        else:
            self.template = template
            self.context = template.prompt([renderable(m) for m in messages])
        self.body, self.messages = body, messages
        self.tools = tuple(Tool(s["function"]["name"], None, s) for s in tools)
        stop = body.get("stop") or ()
        self.stop = (*(self.format.stop if tools else ()), *([stop] if isinstance(stop, str) else stop))
        return Observation(self.context, self.stop)

    @property
    def format(self):
        return TOOL_FORMATS[self.setup.section.tool_format]

    def parse(self, action: Action) -> dict:
        """The assistant message of a sampled action; with tools, its calls read in `env.tool_format` (a call the
        format cannot read leaves the text as it is, as a server's tool parser does)."""
        message = super().parse(action)
        if not self.tools:
            return message
        try:
            content, calls = self.format.parse(message["content"], {t.name: t for t in self.tools})
        except ParseError as e:
            return {**message, "parse_error": str(e)}
        if not calls:
            return message
        calls = [{"id": f"call_{self.answered}_{i}", "type": "function",
                  "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                 for i, c in enumerate(calls)]  # fmt: skip
        return {**message, "content": content, "tool_calls": calls}

    def completion(self, action: Action, message: dict, finish_reason: str) -> dict:
        """A chat completion as vLLM's server returns it with `logprobs` and `return_token_ids`: the engine's ids
        and log-probs of the action, and the prompt's ids."""
        reply = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        logprobs = [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(action.tokens, action.logprobs, strict=True)]  # fmt: skip
        prompt = len(self.context)
        return {"id": f"chatcmpl-lorarl-{id(self):x}-{self.answered}", "object": "chat.completion",
                "created": int(time.time()), "model": self.body.get("model", "lorarl"),
                "choices": [{"index": 0, "message": reply, "finish_reason": finish_reason,
                             "logprobs": {"content": logprobs}, "token_ids": list(action.tokens)}],
                "prompt_token_ids": list(self.context),
                "usage": {"prompt_tokens": prompt, "completion_tokens": len(action.tokens),
                          "total_tokens": prompt + len(action.tokens)}}  # fmt: skip
