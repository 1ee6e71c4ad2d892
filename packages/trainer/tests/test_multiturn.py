"""Multi-turn episodes train on exactly the tokens the engine sampled: the context only grows by appending, template
tokens the engine did not sample get mask 0, log-probs and the loss equal a one-turn-at-a-time float64 loop, the ids
are never decoded and re-encoded, a rewritten context splits into a new sample — and every bad input is named."""

import json
import re
from pathlib import Path

import pytest
import torch
from chat_fixtures import NL, add, chat_model_dir, hermes_call, qwen2_style_tokenizer

from lorarl.trainer import algorithms
from lorarl.trainer.data import Example
from lorarl.trainer.decode import StopStrings, decode
from lorarl.trainer.engines import Completion, SamplingParams
from lorarl.trainer.envs import ENVIRONMENTS
from lorarl.trainer.envs.base import Environment, Observation, Step
from lorarl.trainer.envs.chat import ChatTemplate, TemplateError
from lorarl.trainer.envs.episodes import EnvError, EpisodeRunner
from lorarl.trainer.envs.tools import Tool
from lorarl.trainer.logprobs import micro_batch, response_logprobs
from lorarl.trainer.registry import PluginError
from lorarl.trainer.rollout import Sample, episode_returns, rollout_metrics
from lorarl.trainer.schema import EnvSection
from lorarl.trainer.scoring import Score
from lorarl.trainer.update import episode_advantages, to_batch

TOOLS = [f"{add.__module__}:add"]
ROW = Example("what is 12+7?", "19", (), {}, "train.jsonl line 3")


class Script:
    """The engine's side of a test episode, written out: each live episode's next action, in order (token ids given
    as text pieces, each piece one token, so that ids the tokenizer would not produce can be sampled)."""

    def __init__(self, tokenizer, actions: list[list[list[str]]]):
        self.tokenizer, self.queues = tokenizer, [list(a) for a in actions]
        self.calls: list[list[list[int]]] = []

    def __call__(self, prompts, sampling: list[SamplingParams]) -> list[Completion]:
        self.calls.append([list(p) for p in prompts])
        live = [q for q in self.queues if q]
        completions = []
        for index, (queue, params) in enumerate(zip(live, sampling, strict=True)):
            pieces = queue.pop(0)
            ids = tuple(self.tokenizer.convert_tokens_to_ids(p) for p in pieces)
            text = self.tokenizer.decode(list(ids))
            finished = ids[-1] == self.tokenizer.eos_token_id or any(text.endswith(s) for s in params.stop)
            completions.append(Completion(index, ids, tuple(-0.5 - 0.01 * i for i in range(len(ids))), finished, 0))
        return completions


def pieces(text: str, tokenizer) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))


def runner(tokenizer, **env) -> EpisodeRunner:
    section = EnvSection(**{"name": "tools", "tools": TOOLS, **env})
    return EpisodeRunner(section, tokenizer, eos=tokenizer.eos_token_id)


def play(tokenizer, actions, n=1, **env):
    run = runner(tokenizer, **env)
    episodes = run.start([ROW], n)
    run.play(Script(tokenizer, actions), episodes, SamplingParams(max_tokens=64))
    return episodes


def test_tool_episode_is_the_template_rendering_with_unsampled_tokens_masked():
    """Sampled ids, then exactly what the template renders after them: the Qwen2-style conversation's tokens equal
    its full rendering's, and mask 1 falls on the sampled tokens alone — not on the `\\n` after `<|im_end|>`, nor on
    the `<|im_end|>\\n` that closes a turn stopped at the end of a tool call."""
    tok = qwen2_style_tokenizer()
    call = pieces(hermes_call("add", {"a": 12, "b": 7}), tok)
    answer = [*pieces("19", tok), "<|im_end|>"]
    (episode,) = play(tok, [[call, answer]])
    assert episode.stop_reason == "answer"
    assert episode.metrics == {"tool_calls": 1, "tool_errors": 0}
    (segment,) = episode.segments
    assert episode.env.messages[-1] == {"role": "assistant", "content": "19"}
    rendered = tok.apply_chat_template(episode.env.messages, tools=[Tool.from_function(add).schema], tokenize=False)
    want = tok.encode(rendered.removesuffix("\n"), add_special_tokens=False)  # the engine stops at <|im_end|>
    assert list(segment.prompt) + segment.tokens == want
    call_ids = tok.convert_tokens_to_ids(call)
    sampled = [i for i, m in enumerate(segment.mask) if m]
    assert [segment.tokens[i] for i in sampled] == call_ids + tok.convert_tokens_to_ids(answer)
    between = segment.tokens[len(call_ids) : len(segment.tokens) - len(answer)]
    assert tok.decode(between) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")  # fmt: skip
    assert segment.logprobs[len(call_ids)] == 0.0
    assert segment.logprobs[0] == -0.5


def test_a_template_that_renders_the_last_assistant_turn_apart_continues_by_appending():
    """Qwen3's template gives the last assistant turn an empty `<think>` block and the earlier ones none: the tokens
    after a turn are still what the template puts after it, the history is never re-rendered."""
    tok = qwen2_style_tokenizer()
    assistant = "<|im_start|>assistant" + NL
    tok.chat_template = tok.chat_template.replace(
        assistant + "{{ m['content'] }}",
        assistant + "{%- if loop.last -%}<think>" + NL + NL + "</think>" + NL + NL + "{%- endif -%}{{ m['content'] }}",
    )
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                       tokenize=False)  # fmt: skip
    assert "<think>\n\n</think>\n\na<|im_end|>" in rendered  # the template does render it apart
    call = pieces(hermes_call("add", {"a": 12, "b": 7}), tok)
    (episode,) = play(tok, [[call, [*pieces("19", tok), "<|im_end|>"]]])
    segment = episode.segments[0]
    assert tok.decode(segment.tokens[len(call) : len(segment.tokens) - 3]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_turn_ended_by_the_model_keeps_only_the_boundary_newline_unsampled():
    """A model that ends its tool-call turn itself (`<|im_end|>` sampled): only the template's `\\n` after it is
    added."""
    tok = qwen2_style_tokenizer()
    call = [*pieces(hermes_call("add", {"a": 1, "b": 2}), tok), "<|im_end|>"]
    (episode,) = play(tok, [[call, [*pieces("3", tok), "<|im_end|>"]]])
    segment = episode.segments[0]
    assert segment.tokens[len(call)] == tok.convert_tokens_to_ids("\n")
    assert not segment.mask[len(call)]
    assert tok.decode(segment.tokens[len(call) : len(call) + 2]) == "\n<|im_start|>"


def test_sampled_ids_are_trained_on_not_their_re_encoding():
    """ "1", "2" sampled as two tokens decode to "12", which this tokenizer encodes as one token: the tool still reads
    12, and the training sequence holds the two ids the engine sampled."""
    tok = qwen2_style_tokenizer()
    text_ids = tok.encode("12", add_special_tokens=False)
    assert len(text_ids) == 1  # the re-encoding would differ
    call = [*pieces('<tool_call>\n{"name": "add", "arguments": {"a": ', tok), "1", "2"]
    call += pieces(', "b": 7}}\n</tool_call>', tok)
    (episode,) = play(tok, [[call, ["1", "9", "<|im_end|>"]]])
    assert episode.env.messages[-2] == {"role": "tool", "content": "19", "name": "add"}
    samples = samples_of([episode])
    batch = to_batch(samples, mask_truncated=False)
    one, two = tok.convert_tokens_to_ids(["1", "2"])
    tokens = list(batch.responses[0])
    position = next(i for i in range(len(tokens) - 1) if tokens[i : i + 2] == [one, two])
    assert batch.loss_mask[0, position]
    assert batch.loss_mask[0, position + 1]
    assert text_ids[0] not in tokens[: len(call)]


class Rewriting(Environment):
    """A token-level environment whose second observation is not an extension of the first: a template that rewrites
    its history (as Qwen3's drops earlier reasoning)."""

    def reset(self, example):
        self.turn = 0
        return Observation((1, 2, 3))

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return Step(reward=0.25, observation=Observation((1, 2, 9, 9)))  # not (1, 2, 3) + action
        return Step(reward=1.0, done=True, stop_reason="answer")


def test_a_rewritten_context_starts_a_new_sample_and_advantages_count_episodes():
    tok = qwen2_style_tokenizer()
    ENVIRONMENTS.register("rewriting")(Rewriting)
    try:
        run = EpisodeRunner(EnvSection(name="rewriting"), tok, eos=tok.eos_token_id)
        episodes = run.start([ROW, ROW], 2)
        lengths = [["a", "b"], ["c"], ["d"], ["e", "f", "g"]]  # each episode's first action; then "x"
        actions = [[[*first, "<|im_end|>"], ["x", "<|im_end|>"]] for first in lengths]
        run.play(Script(tok, actions), episodes, SamplingParams(max_tokens=8))
    finally:
        ENVIRONMENTS.remove("rewriting")
    assert [len(e.segments) for e in episodes] == [2, 2, 2, 2]
    first, second = episodes[0].segments
    assert first.prompt == (1, 2, 3)
    assert second.prompt == (1, 2, 9, 9)
    assert all(second.mask)
    assert [e.rewards for e in episodes] == [[0.25, 1.0]] * 4
    # the episode's return on each of its samples; GRPO's statistics over episodes, not samples
    returns = [0.0, 1.0, 2.0, 4.0]
    samples = samples_of(episodes, returns=returns, groups=[0, 0, 1, 1])
    batch = to_batch(samples, mask_truncated=False)
    assert batch.episode.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    advantages = episode_advantages(algorithms.ADVANTAGES["grpo"], batch, None, {"norm_std": True, "eps": 1e-6})
    want = {0: -0.7071, 1: 0.7071, 2: -0.7071, 3: 0.7071}  # (r - mean) / std over each group's two episodes
    for row, episode in enumerate(batch.episode.tolist()):
        values = advantages[row][batch.loss_mask[row]]
        torch.testing.assert_close(values, torch.full_like(values, want[episode]), atol=1e-4, rtol=0)
    with pytest.raises(Exception, match="vary along an episode's tokens"):
        episode_advantages(algorithms.ADVANTAGES["reinforce_pp"], batch, None, {"gamma": 0.5, "eps": 1e-6})
    # the reward logged once per episode too: the mean and spread of the four returns, not of the eight samples
    metrics = rollout_metrics(samples)
    assert metrics["reward/mean"] == pytest.approx(sum(returns) / 4)
    assert metrics["reward/std"] == pytest.approx(float(torch.tensor(returns).std()))


def samples_of(episodes, returns=None, groups=None) -> list[Sample]:
    """Samples as the rollout makes them (one per segment, the episode's return on each)."""
    samples = []
    for number, e in enumerate(episodes):
        total = returns[number] if returns is not None else sum(e.rewards)
        for s in e.segments:
            completion = Completion(e.index, tuple(s.tokens), tuple(s.logprobs), not e.truncated, 0)
            group = groups[number] if groups is not None else e.index
            samples.append(Sample(list(s.prompt), completion, group, total, total, None, None, tuple(s.mask), number))
    return samples


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_log_probs_and_loss_equal_a_one_turn_at_a_time_float64_loop(layout, tmp_path):
    """The trainer's recomputed log-probs of a two-turn episode (holes where the environment spoke) and its PPO loss
    (token-mean, clipped ratios against the engine's log-probs) equal a loop that runs each turn's context through
    the model in float64 and scores that turn's action alone."""
    from transformers import AutoModelForCausalLM

    tok = qwen2_style_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir(tmp_path / "model")).eval()
    calls = [pieces(hermes_call("add", {"a": a, "b": 7}), tok) for a in (3, 40)]
    actions = [[calls[0], ["1", "0", "<|im_end|>"]], [calls[1], ["4", "7", "<|im_end|>"]], [["9", "<|im_end|>"]]]
    run = runner(tok)
    episodes = run.start([ROW], 3)
    run.play(Script(tok, actions), episodes, SamplingParams(max_tokens=64))
    samples = samples_of(episodes, returns=[1.0, 0.0, 0.5])
    batch = to_batch(samples, mask_truncated=False)
    advantages = torch.tensor([0.8, -1.1, 0.3])[:, None] * batch.loss_mask
    with torch.no_grad():
        logp, _ = response_logprobs(model, micro_batch(batch.prompts, batch.responses, batch.width, "cpu", layout),
                                    temperature=1.0)  # fmt: skip
    loss, _ = algorithms.policy_loss("ppo", logp, batch.rollout_logp, advantages, batch.loss_mask,
                                     clip=algorithms.ClipRange(0.2, 0.28), loss_agg_mode="token-mean")  # fmt: skip

    reference = model.to(torch.float64)
    terms, count = [], 0
    for row, e in enumerate(episodes):
        (segment,) = e.segments
        runs = [p for p, m in enumerate(segment.mask) if m and (p == 0 or not segment.mask[p - 1])]
        assert len(runs) == len(e.actions)
        for start, action in zip(runs, e.actions, strict=True):  # each turn alone: what the engine saw, its action
            context = list(segment.prompt) + segment.tokens[:start]
            assert segment.tokens[start : start + len(action.tokens)] == list(action.tokens)
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([context + list(action.tokens)])).logits[0]
            log_p = torch.log_softmax(logits.double(), -1)
            positions = range(len(context) - 1, len(context) - 1 + len(action.tokens))
            turn_logp = torch.stack([log_p[p, t] for p, t in zip(positions, action.tokens, strict=True)])
            torch.testing.assert_close(logp[row, start : start + len(action.tokens)].double(), turn_logp, atol=1e-5,
                                       rtol=0)  # fmt: skip
            old = torch.tensor([-0.5 - 0.01 * i for i in range(len(action.tokens))], dtype=torch.float64)
            ratio = (turn_logp - old).exp()
            a = float(advantages[row][batch.loss_mask[row]][0])
            terms.append(torch.maximum(-a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.28)).sum())
            count += len(action.tokens)
        assert batch.loss_mask[row].sum() == sum(len(a.tokens) for a in e.actions)
    torch.testing.assert_close(loss.double(), sum(terms) / count, atol=1e-6, rtol=0)


def test_reinforce_pp_discounts_over_action_tokens_only():
    """REINFORCE++'s discounted returns skip an episode's holes: equal to the same action tokens laid end to end."""
    rewards, group = torch.tensor([1.0, 2.0]), torch.tensor([0, 1])
    holed = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    packed = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    got = algorithms.advantages("reinforce_pp", rewards, group, holed, gamma=0.9, eps=1e-6)
    want = algorithms.advantages("reinforce_pp", rewards, group, packed, gamma=0.9, eps=1e-6)
    for row in range(2):
        torch.testing.assert_close(got[row][holed[row]], want[row][packed[row]])


def test_stop_strings_cut_the_hf_decode_where_the_unstopped_one_contains_them(tmp_path):
    """The same seeded sampling with and without a stop string: each row's tokens agree up to the stop, a stopped row
    ends with the token that completed the string (vLLM's `stop`), a row that never held it runs on."""
    from transformers import AutoModelForCausalLM

    tok = qwen2_style_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir(tmp_path / "model")).eval()
    ids = torch.tensor([tok.encode("<|im_start|>assistant\n", add_special_tokens=False)] * 6)
    mask = torch.ones_like(ids)
    common = {"max_tokens": 40, "temperature": 1.5, "top_p": 1.0, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    free, _ = decode(model, ids, mask, generator=torch.Generator().manual_seed(3), **common)
    texts = [tok.decode(row) for row in free.tolist()]
    stop_string = next(c for c in "aeiou" if sum(c in t for t in texts) >= 2)
    stop = StopStrings(tok, (stop_string,), StopStrings.candidates_of(tok, (stop_string,), len(tok)))
    stopped, logp = decode(model, ids, mask, generator=torch.Generator().manual_seed(3), stop=stop, **common)
    for row, text in enumerate(texts):
        if row in stop.ends:
            end = stop.ends[row]
            assert stopped[row, :end].tolist() == free[row, :end].tolist()
            assert stop_string in tok.decode(stopped[row, :end].tolist())  # completed by the last token
            assert stop_string not in tok.decode(stopped[row, : end - 1].tolist())
            assert (logp[row, end:] == 0).all()
        else:
            assert stop_string not in text.split("<|im_end|>")[0]
    assert stop.ends


def test_a_stop_string_ending_in_a_byte_level_token_stops():
    """A byte-level vocabulary (GPT-2, Qwen, Llama 3) spells "\\n" as "Ċ": the token that completes "a\\n" is found by
    its decoded text, and ends the row there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    a, newline = tok.encode("a\n", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(newline) == "Ċ"
    stop = StopStrings(tok, ("a\n",), StopStrings.candidates_of(tok, ("a\n",), len(tok)))
    history = [torch.tensor([a, a]), torch.tensor([newline, a])]
    assert stop(history, history[-1], torch.zeros(2, dtype=torch.bool)).tolist() == [True, False]
    assert stop.ends == {0: 2}


def test_bounds_end_episodes_with_their_reason():
    tok = qwen2_style_tokenizer()
    call = pieces(hermes_call("add", {"a": 1, "b": 2}), tok)
    looping = [[call] * 5]
    (episode,) = play(tok, looping, max_turns=3)
    assert episode.stop_reason == "max_turns"
    assert len(episode.actions) == 3
    assert episode.truncated
    (episode,) = play(tok, looping, max_tokens=len(call) + 5)  # the tool's answer does not fit
    assert episode.stop_reason == "budget"
    assert len(episode.actions) == 1
    (episode,) = play(tok, [[call[:10]]], max_tokens=8)  # cut mid-action at the budget
    assert episode.stop_reason == "budget"
    assert len(episode.actions[0].tokens) == 8
    samples = samples_of([episode])
    assert not samples[0].completion.finished  # truncated: mask_truncated drops its loss
    assert not to_batch(samples, mask_truncated=True).loss_mask.any()


def test_tool_errors_and_parse_errors_go_back_to_the_model_or_end_the_episode():
    tok = qwen2_style_tokenizer()
    bad_args = pieces(hermes_call("add", {"a": 1, "c": 2}), tok)  # add() got an unexpected keyword
    (episode,) = play(tok, [[bad_args, [*pieces("3", tok), "<|im_end|>"]]])
    assert episode.metrics == {"tool_calls": 1, "tool_errors": 1}
    assert episode.stop_reason == "answer"
    assert episode.env.messages[2]["content"].startswith("error: TypeError")
    broken = pieces("<tool_call>\n{not json}\n</tool_call>", tok)
    (episode,) = play(tok, [[broken]])
    assert episode.stop_reason == "parse_error"
    assert episode.metrics == {"parse_errors": 1}
    (episode,) = play(tok, [[broken, [*pieces("3", tok), "<|im_end|>"]]], on_parse_error="feedback")
    assert episode.stop_reason == "answer"
    assert "not JSON" in episode.env.messages[2]["content"]


class Exploding(Environment):
    def reset(self, example):
        return Observation((1, 2))

    def step(self, action):
        raise RuntimeError("the game server is down")


def test_an_environment_that_raises_stops_the_run_naming_the_row_or_is_scored():
    tok = qwen2_style_tokenizer()
    ENVIRONMENTS.register("exploding")(Exploding)
    try:
        run = EpisodeRunner(EnvSection(name="exploding"), tok, eos=tok.eos_token_id)
        with pytest.raises(EnvError, match=r"raised in step on the episode of train.jsonl line 3: RuntimeError: the "
                                           r"game server is down"):  # fmt: skip
            run.play(Script(tok, [[["a", "<|im_end|>"]]]), run.start([ROW], 1), SamplingParams())
        run = EpisodeRunner(EnvSection(name="exploding", on_error="score", error_score=-1.0), tok, eos=tok.eos_token_id)
        episodes = run.start([ROW], 1)
        run.play(Script(tok, [[["a", "<|im_end|>"]]]), episodes, SamplingParams())
        assert episodes[0].stop_reason == "error"
        assert episodes[0].rewards == [-1.0]
        assert episodes[0].metrics == {"errors": 1}
        assert episode_returns(episodes, [Score(5.0, (5.0,), 0)]) == [-1.0]  # the reward functions' 5 not added
    finally:
        ENVIRONMENTS.remove("exploding")


def test_env_that_is_not_an_environment_is_named(tmp_path):
    from lorarl.trainer.config import ConfigError, load_config

    plugin = tmp_path / "plugin.py"
    plugin.write_text("def not_an_env():\n    pass\n\nclass NotAnEnv:\n    pass\n")
    for name in ("not_an_env", "NotAnEnv"):
        with pytest.raises(ConfigError, match=rf"env.name='.*plugin.py:{name}'.* expected a subclass of "
                                              r"lorarl.trainer.envs.Environment"):  # fmt: skip
            load_config(None, [f"env={plugin}:{name}"])
    with pytest.raises(ConfigError, match=r"env.tools=.* needs an environment"):
        load_config(None, [f"env.tools=[{TOOLS[0]}]"])
    with pytest.raises(PluginError, match=r"unknown environment 'tool'.*did you mean 'tools'"):
        ENVIRONMENTS["tool"]


README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_s_chat_environment_trains_as_written_and_a_model_without_a_template_is_one_line(tmp_path, capsys):
    """The README's `# my_env.py` (`Guess`), run by its command (`task=calculator`: the embedded calculator model has
    a chat template); on the embedded default, which has none, the run stops before loading the model, in one line."""
    from lorarl.trainer.cli import main

    body = re.search(r"```python\n(# my_env\.py\n.*?)```", README.read_text(), re.S)[1]
    command = re.search(r"uv run trainer (task=calculator env=my_env\.py:Guess)\b", README.read_text())[1].split()
    (tmp_path / "my_env.py").write_text(body)
    out = tmp_path / "out"
    settings = ["trainer.steps=2", "trainer.eval_every=0", "data.batch_size=4", f"trainer.output_dir={out}"]
    overrides = [c.replace("my_env.py", str(tmp_path / "my_env.py")) for c in command]
    assert main([*overrides, *settings]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    capsys.readouterr()
    assert main([overrides[1], *settings[1:], f"trainer.output_dir={tmp_path / 'plain'}"]) == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [f"error: env.name={tmp_path / 'my_env.py'}:Guess: a chat environment needs a tokenizer with a "
                       "chat template, and the policy's has none (a chat model — task=calculator's embedded one has "
                       "a template —, or a token-level Environment)"]  # fmt: skip


def test_a_first_observation_longer_than_the_prompts_may_be_is_named():
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(EnvSection(name="tools", tools=TOOLS), tok, eos=tok.eos_token_id, max_prompt_tokens=64)
    with pytest.raises(EnvError, match=r"first observation of train.jsonl line 3 holds \d+ tokens \(its tools and "
                                       r"template included\), more than data.max_prompt_tokens=64"):  # fmt: skip
        run.start([ROW], 1)


def test_a_tool_without_a_described_signature_is_named():
    from lorarl.trainer.envs.tools import load_tools
    from lorarl.trainer.errors import TrainerError

    with pytest.raises(TrainerError, match=r"env\.tools: 'json:dumps' is not a usable tool .*: Argument obj"):
        load_tools(["json:dumps"])


def test_a_template_that_rewrites_history_is_refused_by_name():
    tok = qwen2_style_tokenizer()
    tok.chat_template = ("{%- for m in messages -%}{%- if loop.last -%}<|im_start|>{{ m['role'] }}{{ m['content'] }}"
                         "<|im_end|>{%- else -%}{{ m['role'] }}{%- endif -%}{%- endfor -%}")  # fmt: skip
    template = ChatTemplate(tok)
    with pytest.raises(TemplateError, match=r"rewrites an assistant turn when messages with roles \['user'\]"):
        template.appended([{"role": "user", "content": "again"}])


def test_episodes_waiting_go_to_the_engine_in_one_call_each_with_a_seed_of_its_episode_and_turn():
    tok = qwen2_style_tokenizer()
    call = pieces(hermes_call("add", {"a": 1, "b": 2}), tok)
    script = Script(tok, [[call, ["3", "<|im_end|>"]], [["9", "<|im_end|>"]], [call, call, ["3", "<|im_end|>"]]])
    run = runner(tok)
    episodes = run.start([ROW], 3)
    requests = []

    def engine(prompts, sampling):
        requests.append([(params.seed, params.stop, params.max_tokens) for params in sampling])
        return script(prompts, sampling)

    run.play(engine, episodes, SamplingParams(max_tokens=64, seed=5))
    assert [len(c) for c in script.calls] == [3, 2, 1]  # instant environments: every episode still going, each call
    stop = ("</tool_call>",)
    assert requests == [[(5, stop, 64), (5 + 104729, stop, 64), (5 + 2 * 104729, stop, 64)],
                        [(5 + 7919, stop, 64), (5 + 2 * 104729 + 7919, stop, 64)],  # episodes 0 and 2, turn 2
                        [(5 + 2 * 104729 + 2 * 7919, stop, 64)]]  # fmt: skip


def test_the_calculator_task_config_loads():
    from lorarl.trainer.config import load_config

    config = load_config(None, ["task=calculator", "env.max_turns=4"])
    assert config.env.name == "tools"
    assert config.env.tool_format == "compact"
    assert config.env.max_turns == 4
    assert config.model.path == "calculator"
    assert config.env.tools == ["lorarl.trainer.calculator_task:mul"]
    with pytest.raises(Exception, match="task=nope: unknown task; choose one of"):
        load_config(None, ["task=nope"])


def test_the_calculator_task_trains_and_its_checkpoint_evaluates_in_episodes(tmp_path):
    """`task=calculator` end to end on the HF engine: episodes of more than one turn, the engine's log-probs of the
    action tokens equal to the trainer's (float32 both), and `trainer eval` of the checkpoint playing episodes too:
    its greedy accuracy is the run's last validation accuracy (the same greedy episodes, the adapter unmerged there)."""
    from lorarl.trainer.cli import main

    out = tmp_path / "out"
    common = ["data.val_size=32", "rollout.dtype=float32"]
    assert main(["task=calculator", "trainer.steps=2", "trainer.eval_every=2", "data.batch_size=4", *common,
                 f"trainer.output_dir={out}"]) == 0  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert all(r["env/turns"] >= 1 for r in steps)
    assert any(r.get("env/tool_calls", 0) > 0 for r in steps)
    assert max(r["rollout/abs_logp_diff"] for r in steps) < 1e-4
    result = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(out / "checkpoints" / "step_2"), "--n", "2", "--out", str(result)]) == 0
    evaluated = json.loads(result.read_text())
    assert evaluated["prompts"] == 32
    assert abs(evaluated["greedy_accuracy"] - records[-1]["val/accuracy"]) <= 2 / 32


PLUGIN = '''
from dataclasses import dataclass

from lorarl.trainer.envs import register_env
from lorarl.trainer.envs.chat import ChatEnvironment, Reply
from lorarl.trainer.registry import option


@dataclass
class RetrySettings:
    feedback: str = option("wrong, try again", "what the model hears after a wrong answer")


@register_env("retry", settings=RetrySettings)
class Retry(ChatEnvironment):
    """Answer; after a wrong one hear the feedback and try again."""

    def respond(self, message):
        if message["content"].strip() == self.answer:
            return Reply(reward=1.0, done=True, stop_reason="right")
        return Reply([{"role": "user", "content": self.settings.feedback}])

    def start(self, example):
        self.answer = example.answer
        return super().start(example)
'''


def test_a_plugin_environment_brings_its_own_settings(tmp_path):
    """`env=file.py:Name` of a class registered with settings: `--help` lists them, a config sets them, the
    environment reads them, and the data row reaches its `start`."""
    from lorarl.trainer.config import help_text, load_config

    plugin = tmp_path / "retry.py"
    plugin.write_text(PLUGIN)
    spec = f"{plugin}:Retry"
    try:
        assert "env.retry.feedback" in help_text(None, [f"env={spec}"])
        config = load_config(None, [f"env={spec}", "env.retry.feedback=try harder"])
        tok = qwen2_style_tokenizer()
        run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
        episodes = run.start([ROW], 1)
        run.play(Script(tok, [[["7", "<|im_end|>"], ["1", "9", "<|im_end|>"]]]), episodes, SamplingParams())
    finally:
        ENVIRONMENTS.remove("retry")
    (episode,) = episodes
    assert episode.stop_reason == "right"
    assert episode.rewards == [0.0, 1.0]
    assert episode.env.messages[2] == {"role": "user", "content": "try harder"}


@pytest.mark.parametrize("extra", [["rollout.worker=process"], ["trainer.backend=ray"], ["algorithm=ppo"],
                                   ["actor.layout=packed", "algorithm=drgrpo"]],
                         ids=["process", "ray", "ppo-critic", "packed-drgrpo"])  # fmt: skip
def test_the_calculator_task_in_each_placement_and_with_a_critic(tmp_path, extra):
    """Episodes through every placement of the HF engine (in a process of its own, a Ray actor), PPO's critic on
    episodes (GAE over the action tokens), the packed layout with Dr. GRPO's constant length (env.max_tokens)."""
    from lorarl.trainer.cli import main

    out = tmp_path / "out"
    assert main(["task=calculator", "trainer.steps=2", "trainer.eval_every=0", "data.batch_size=4",
                 "rollout.dtype=float32", f"trainer.output_dir={out}", *extra]) == 0  # fmt: skip
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert len(steps) == 2
    assert all(r["env/turns"] >= 1 for r in steps)
    assert max(r["rollout/abs_logp_diff"] for r in steps) < 1e-4
    if "algorithm=ppo" in extra:
        assert all("critic/vf_loss" in r for r in steps)


REWRITING_PLUGIN = '''
from lorarl.trainer.envs.base import Environment, Observation, Step


class Rewrite(Environment):
    """Token level: after the first action the context is rewritten (not an extension), then the episode ends."""

    def reset(self, example):
        self.turn = 0
        return Observation(tuple(example.prompt_ids))

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return Step(reward=0.5, observation=Observation(tuple(self.tokenizer.encode("<user>1*1<eos><bot>"))))
        return Step(reward=float(len(action.tokens) % 2), done=True, stop_reason="second")
'''


def test_a_run_whose_environment_rewrites_the_context_trains_on_split_samples(tmp_path):
    """End to end: each episode that reaches its second turn becomes two samples (`env/samples_per_episode`), the run
    trains on both with one advantage per episode; with an estimator whose advantages vary along the tokens it stops
    naming the cause."""
    from lorarl.trainer.cli import main

    plugin = tmp_path / "rewrite.py"
    plugin.write_text(REWRITING_PLUGIN)
    common = ["task=calculator", f"env={plugin}:Rewrite", "env.tools=[]", "reward.fn=default", "trainer.steps=2",
              "trainer.eval_every=0", "data.batch_size=4"]  # fmt: skip
    out = tmp_path / "out"
    assert main([*common, f"trainer.output_dir={out}"]) == 0
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    for r in steps:  # an episode whose first action ran to rollout.max_tokens ends there, unsplit
        assert 1.5 < r["env/samples_per_episode"] <= 2
        assert r["env/stop/second"] > 0.5
        assert r["env/turn_reward/1"] == 0.5
    assert main([*common, "algorithm.adv_estimator=reinforce_pp", "algorithm.reinforce_pp.gamma=0.5",
                 f"trainer.output_dir={tmp_path / 'out2'}"]) == 2  # fmt: skip
