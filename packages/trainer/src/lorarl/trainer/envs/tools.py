"""Tools from plain typed Python functions, the formats tool calls are written in, and the environment that runs
them.

A tool is a function with type hints and a Google-style docstring (`Args:`): its JSON schema comes from transformers'
`get_json_schema`, as TRL's `tools=` does, and reaches the model through the chat template's `tools=`. The model's
calls are parsed from its text in the run's format — `hermes` (`<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, Qwen-family templates) or `compact` (`<call>name arg1 arg2</call>`, short enough for a small model to
learn) — run, and their results (or errors) fed back as `tool` messages. A turn ends at the end of a tool call (the
format's stop string) or at end-of-sequence; an answer without a call ends the episode.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from lorarl.trainer.envs.base import Action
from lorarl.trainer.envs.chat import ChatEnvironment, Reply
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.registry import import_object

JSON_TYPES = {"integer": int, "number": float, "string": str, "boolean": lambda text: text.lower() == "true"}


@dataclass(frozen=True)
class Tool:
    """A callable tool: its name, function and JSON schema (`{"type": "function", "function": {...}}`)."""

    name: str
    fn: Callable
    schema: dict

    @classmethod
    def from_function(cls, fn: Callable, origin: str = "", key: str = "env.tools") -> Tool:
        """`fn` as a tool; an error names it (`origin`) and the configuration `key` it came from."""
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as e:
            raise TrainerError(f"{key}: {origin or fn!r} is not a usable tool (a function with type hints and a "
                               f"docstring whose Args: describe each argument): {e}") from None  # fmt: skip
        return cls(schema["function"]["name"], fn, schema)

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"].get("properties", {})

    @property
    def is_async(self) -> bool:
        """An `async def` tool: awaited on the episodes' loop (`ToolEnvironment.astep`)."""
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, arguments: dict) -> str:
        result = self.fn(**arguments)
        if inspect.iscoroutine(result):  # an async tool called where no loop runs (TRL awaits them too)
            result = asyncio.run(result)
        return _text(result)

    async def acall(self, arguments: dict) -> str:
        """The tool's result, awaited here where it is `async`, else from a thread (it may block)."""
        result = await self.fn(**arguments) if self.is_async else await asyncio.to_thread(self.fn, **arguments)
        return _text(result)


def _text(result) -> str:
    return result if isinstance(result, str) else json.dumps(result)


def load_tools(specs: list[str], schemas: list[dict] | None = None) -> tuple[Tool, ...]:
    """`env.tools`: functions by import path (`package.module:fn` or `path/to/file.py:fn`); with their `schemas` (as
    the trainer read them), the functions alone (an environment's worker process: transformers' schema reader
    imports torch, half a gigabyte)."""
    tools = []
    for index, spec in enumerate(specs):
        try:
            fn = import_object(spec)
        except Exception as e:
            raise TrainerError(f"env.tools: cannot load {spec!r}: {e}") from None
        if not callable(fn):
            raise TrainerError(f"env.tools: {spec!r} is a {type(fn).__name__}, expected a function")
        tools.append(Tool(schemas[index]["function"]["name"], fn, schemas[index]) if schemas
                     else Tool.from_function(fn, spec))  # fmt: skip
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise TrainerError(f"env.tools: two tools share a name: {names}")
    return tuple(tools)


class ParseError(ValueError):
    """A tool call the format cannot read."""


def call(name: str, arguments: dict) -> dict:
    """A tool call as chat templates take it (OpenAI's shape, arguments as a mapping)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class Hermes:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: the format of Qwen-family (Hermes) templates."""

    stop = ("</tool_call>",)
    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: dict[str, Tool]) -> tuple[str, list[dict]]:
        calls = []
        for body in self.pattern.findall(text):
            try:
                data = json.loads(body.strip())
            except json.JSONDecodeError as e:
                raise ParseError(f"a tool call that is not JSON: {e}") from None
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                raise ParseError(f'a tool call needs {{"name": ..., "arguments": {{...}}}}, got {body.strip()!r}')
            arguments = data.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError as e:
                    raise ParseError(f"tool call arguments that are not JSON: {e}") from None
            if not isinstance(arguments, dict):
                raise ParseError(f"tool call arguments must be an object, got {arguments!r}")
            calls.append(call(data["name"], arguments))
        return self.pattern.split(text, maxsplit=1)[0].strip(), calls


class Compact:
    """`<call>name arg1 arg2</call>`: positional arguments in the tool's parameter order, converted by their JSON
    types — a format a small model learns in a few tokens."""

    stop = ("</call>",)
    pattern = re.compile(r"<call>(.*?)(?:</call>|$)", re.DOTALL)

    def parse(self, text: str, tools: dict[str, Tool]) -> tuple[str, list[dict]]:
        calls = []
        for body in self.pattern.findall(text):
            if not body.split():
                raise ParseError("an empty tool call")
            name, *values = body.split()
            if name not in tools:
                raise ParseError(f"no tool named {name!r} (tools: {sorted(tools)})")
            parameters = tools[name].parameters
            if len(values) != len(parameters):
                raise ParseError(f"{name} takes {len(parameters)} arguments ({', '.join(parameters)}), got "
                                 f"{len(values)}")  # fmt: skip
            arguments = {}
            for (key, spec), value in zip(parameters.items(), values, strict=True):
                try:
                    arguments[key] = JSON_TYPES.get(spec.get("type"), str)(value)
                except ValueError:
                    raise ParseError(f"{name}: {key}={value!r} is not a {spec.get('type')}") from None
            calls.append(call(name, arguments))
        return self.pattern.split(text, maxsplit=1)[0].strip(), calls


TOOL_FORMATS = {"hermes": Hermes(), "compact": Compact()}


class ToolEnvironment(ChatEnvironment):
    """`env.name=tools`: the model answers the data row's prompt, calling the run's tools (`env.tools`) on the way.
    Each call's result — or its error, counted in `env/tool_errors` — comes back as a `tool` message, cut to
    `env.max_tool_tokens`; a turn without a call is the answer, and ends the episode (the reward functions score it).
    A call the format cannot read ends the episode (`parse_error`), or with `env.on_parse_error=feedback` goes back
    to the model as the tool's message."""

    @property
    def format(self):
        return TOOL_FORMATS[self.setup.section.tool_format]

    @property
    def stop(self) -> tuple[str, ...]:
        return self.format.stop

    def parse(self, action: Action) -> dict:
        message = super().parse(action)
        try:
            content, calls = self.format.parse(message["content"], {t.name: t for t in self.tools})
        except ParseError as e:
            return {**message, "parse_error": str(e)}
        return {**message, "content": content, "tool_calls": calls} if calls else message

    @property
    def steps_async(self) -> bool:
        """With an `async def` tool, a step is awaited on the episodes' loop (`astep`): its async tools run there."""
        return any(tool.is_async for tool in self.tools)

    def respond(self, message: dict) -> Reply:
        ended = self._without_calls(message)
        if ended is not None:
            return ended
        return self._replied(message["tool_calls"], [self._call(c, lambda tool, args: tool(args))
                                                     for c in message["tool_calls"]])  # fmt: skip

    async def arespond(self, message: dict) -> Reply:
        """`respond`, the message's calls run concurrently: async tools awaited on the loop, the others on threads."""
        ended = self._without_calls(message)
        if ended is not None:
            return ended
        calls = message["tool_calls"]

        async def run(call: dict):
            pending = self._call(call, lambda tool, args: tool.acall(args))
            if isinstance(pending, Exception):
                return pending
            try:
                return await pending
            except Exception as e:
                return e

        return self._replied(calls, await asyncio.gather(*(run(c) for c in calls)))

    def _without_calls(self, message: dict) -> Reply | None:
        """The reply to a message that calls no tool (an answer, or one that failed to parse); None if it calls."""
        if "parse_error" in message:
            if self.setup.section.on_parse_error == "stop":
                return Reply(done=True, stop_reason="parse_error", metrics={"parse_errors": 1})
            return Reply([self.tool_message(f"error: {message['parse_error']}")], metrics={"parse_errors": 1})
        return None if message.get("tool_calls") else Reply(done=True, stop_reason="answer")

    def _call(self, call: dict, run: Callable):
        """`run(tool, arguments)` for one call, or the exception of one that names no tool or raises."""
        tools = {t.name: t for t in self.tools}
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if name not in tools:
            return LookupError(f"no tool named {name!r} (tools: {sorted(tools)})")
        try:
            return run(tools[name], arguments)
        except Exception as e:
            return e

    def _replied(self, calls: list[dict], results: list) -> Reply:
        """The tool messages of `calls`' results; a tool's failure goes back to the model as its message."""
        replies, errors = [], 0
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, Exception):
                result, errors = f"error: {type(result).__name__}: {result}", errors + 1
            replies.append(self.tool_message(result, call["function"]["name"]))
        return Reply(replies, metrics={"tool_calls": len(calls), "tool_errors": errors})

    def tool_message(self, content: str, name: str | None = None) -> dict:
        """A `tool` message, its content cut to `env.max_tool_tokens` tokens."""
        limit = self.setup.section.max_tool_tokens
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if limit and len(ids) > limit:
            content = self.tokenizer.decode(ids[:limit])
        return {"role": "tool", "content": content, **({"name": name} if name else {})}
