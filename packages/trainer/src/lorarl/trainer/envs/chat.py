"""The message-level layer: environments that think in chat messages, rendered through the tokenizer's own chat
template — without ever re-tokenizing what the engine sampled.

A new message is tokenized as what the template renders after the assistant turn of a fixed reference conversation
(a user turn and an assistant turn) followed by the new messages: exactly what the template puts after an assistant
turn for those messages, whatever came before (and however it renders the turns before: Qwen3 gives the last
assistant turn an empty `<think>` block, the others none). What the template closes an assistant turn with, and the
engine did not sample (the `\\n` after `<|im_end|>`, the whole `<|im_end|>\\n` after a turn stopped at the end of a
tool call), is prepended. The context therefore only ever grows by appending, and every appended token gets mask 0.
A template that renders the reference assistant turn differently once messages follow it (other content, another
end) is refused by name: the conversation could not be continued without rewriting what the engine saw.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lorarl.trainer.data import prompt_messages
from lorarl.trainer.envs.base import Action, Environment, Observation, Step
from lorarl.trainer.errors import TrainerError

MARK = "lorarl-reference-turn"  # the reference conversation's assistant content: found again in its rendering
REFERENCE = ({"role": "user", "content": "lorarl-reference-question"}, {"role": "assistant", "content": MARK})


class TemplateError(TrainerError):
    """The chat template cannot be continued by appending (or cannot render what was asked)."""


class ChatTemplate:
    """A tokenizer's chat template, rendering a conversation's first prompt and then only what each turn appends.
    `tools`: JSON schemas offered through the template (`tools=`), in the first prompt."""

    def __init__(self, tokenizer, tools: Sequence[dict] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("a chat environment needs a tokenizer with a chat template, and the policy's has none "
                                "(a chat model — task=calculator's embedded one has a template —, or a token-level "
                                "Environment)")  # fmt: skip
        self.tokenizer, self.tools = tokenizer, list(tools) or None
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id])
        rendered = self.render(list(REFERENCE), generation_prompt=False)
        if MARK not in rendered:
            raise TemplateError("the chat template does not render an assistant message's content")
        self.closing = rendered[rendered.rindex(MARK) + len(MARK) :]  # what ends an assistant turn

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)  # fmt: skip
        except Exception as e:  # jinja's own errors (a template's raise_exception, an undefined key)
            roles = [m.get("role") for m in messages]
            raise TemplateError(f"the chat template cannot render messages with roles {roles}: {e}") from None

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict]) -> tuple[int, ...]:
        """The first observation: `messages` rendered with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def continuation(self, action: Action, messages: list[dict]) -> tuple[int, ...]:
        """The tokens that follow the sampled `action` when `messages` answer it: the rest of the assistant turn that
        the engine did not sample, `messages`, and the next generation prompt."""
        return self.encode(self.unsampled_closing(action) + self.appended(messages))

    def unsampled_closing(self, action: Action) -> str:
        """What the template closes the assistant turn with after the action: after its end-of-sequence token when
        the engine sampled one, all of it when the turn stopped on a stop string."""
        if action.eos and self.eos_text in self.closing:
            return self.closing[self.closing.index(self.eos_text) + len(self.eos_text) :]
        return self.closing

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one template per run; tool messages repeat)
    def _appended(self, key: str) -> str:
        messages = json.loads(key)
        after = self.render([*REFERENCE, *messages], generation_prompt=True)
        turn_end = MARK + self.closing  # what precedes the reference's turn may differ (Qwen3: a <think> block)
        if turn_end not in after:
            roles = [m.get("role") for m in messages]
            raise TemplateError(f"the chat template rewrites an assistant turn when messages with roles {roles} "
                                f"follow it (its content then {self.closing!r} no longer end it): the conversation "
                                "cannot be continued by appending")  # fmt: skip
        return after[after.index(turn_end) + len(turn_end) :]

    def appended(self, messages: list[dict]) -> str:
        """The text the template appends after an assistant turn for `messages`, then the generation prompt."""
        return self._appended(json.dumps(messages))


@functools.lru_cache(maxsize=8)
def chat_template(tokenizer, tools_key: str) -> ChatTemplate:
    """One `ChatTemplate` per tokenizer and tool set (its reference renderings are computed once)."""
    return ChatTemplate(tokenizer, json.loads(tools_key))


@dataclass(frozen=True)
class Reply:
    """A chat environment's answer to an assistant message: the messages it appends (tool results, feedback), the
    turn's reward, and whether (and why) the episode ends."""

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    stop_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


class ChatEnvironment(Environment):
    """An environment at the message level: implement `respond` (and `start` for first messages other than the data
    row's prompt). The assistant messages it sees are parsed from the sampled text (content, and tool calls in the
    run's `env.tool_format` when it has tools); the token level — the template's prefix, the unsampled closing of each
    turn, mask 0 on everything appended — is done here."""

    stop: tuple[str, ...] = ()  # strings that end an assistant turn besides end-of-sequence

    def start(self, example) -> list[dict]:
        """The conversation's first messages: the data row's prompt (text or messages) and `data.system_prompt`."""
        return prompt_messages(example.prompt, self.setup.system_prompt, "a data row")

    def respond(self, message: dict) -> Reply:
        """The answer to one assistant message (`{"role": "assistant", "content", "tool_calls"?, "parse_error"?}`)."""
        raise NotImplementedError

    def parse(self, action: Action) -> dict:
        """The assistant message of a sampled action: its text without the end-of-sequence token."""
        text = action.text
        eos_text = self.template.eos_text
        if action.eos and text.endswith(eos_text):
            text = text[: -len(eos_text)]
        return {"role": "assistant", "content": text}

    @functools.cached_property
    def template(self) -> ChatTemplate:
        schemas = [tool.schema for tool in self.tools]
        return chat_template(self.tokenizer, json.dumps(schemas))

    def reset(self, example) -> Observation:
        self.messages = self.start(example)
        self.prompt_length, self.stepped = len(self.messages), 0
        self.context = self.template.prompt(self.messages)
        return Observation(self.context, self.stop)

    def conversation(self, actions: list[Action]) -> tuple[list[dict], list[dict]]:
        after = self.messages[self.prompt_length :]
        if len(actions) > self.stepped:  # the last action, cut at a length, was never stepped
            after = [*after, _without_parse_error(self.parse(actions[-1]))]
        return self.messages[: self.prompt_length], after

    steps_async = False  # whether the runner awaits `astep` on the episodes' loop instead of `step` on a thread

    def step(self, action: Action) -> Step:
        return self._stepped(action, self.respond(self._sent(action)))

    async def astep(self, action: Action) -> Step:
        """`step` with `arespond` awaited (where `steps_async`)."""
        return self._stepped(action, await self.arespond(self._sent(action)))

    async def arespond(self, message: dict) -> Reply:
        """`respond`, awaited: a subclass whose answers are `async` (`steps_async`) implements it."""
        raise NotImplementedError

    def _sent(self, action: Action) -> dict:
        """The action's assistant message, kept in the conversation."""
        message = self.parse(action)
        self.stepped += 1
        self.messages.append(_without_parse_error(message))
        return message

    def _stepped(self, action: Action, reply: Reply) -> Step:
        if not isinstance(reply, Reply):
            raise TypeError(f"{type(self).__name__}.respond returned {type(reply).__name__}, expected a Reply")
        if reply.done:
            return Step(reply.reward, True, stop_reason=reply.stop_reason or "done", metrics=reply.metrics)
        if not reply.messages or not all(isinstance(m, Mapping) and "role" in m for m in reply.messages):
            raise TypeError(f"{type(self).__name__}.respond: a reply that goes on needs messages with a role, got "
                            f"{reply.messages!r}")  # fmt: skip
        self.messages += reply.messages
        self.context = self.context + action.tokens + self.template.continuation(action, reply.messages)
        return Step(reply.reward, False, Observation(self.context, self.stop), metrics=reply.metrics)


def _without_parse_error(message: dict) -> dict:
    """An assistant message as the conversation keeps it (the parse error is for `respond` alone)."""
    return {k: v for k, v in message.items() if k != "parse_error"}
