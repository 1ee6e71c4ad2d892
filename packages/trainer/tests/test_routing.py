"""Routing replay (R3): the experts the HF engine chose, recorded token by token and layer by layer, are the experts
the trainer's forwards compute with — in every micro-batch layout, in gradient checkpointing's recompute too — and
their weights come from the trainer's own router, whose gradients (and its LoRA's, and the experts') match a float64
per-token computation. Replaying the router's own choice changes nothing, bit for bit; a route that cannot apply is
refused naming its episode."""

import json

import numpy as np
import pytest
import torch
import transformers

from lorarl.trainer import default_task
from lorarl.trainer.cli import main
from lorarl.trainer.engines.base import Completion, SamplingParams
from lorarl.trainer.engines.hf import HFSettings, generate_with_hf
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.logprobs import micro_batch, response_logprobs
from lorarl.trainer.models import lora_config
from lorarl.trainer.recompute import checkpoint_layers
from lorarl.trainer.rollout import Sample
from lorarl.trainer.routing import Plan, Routers, active, attach
from lorarl.trainer.schema import LoraSection
from lorarl.trainer.update import rerouted_tokens, sample_routes

MOE = default_task.EMBEDDED["default-moe"]


def tiny_mixture(kind: str, layers: int = 2, **kwargs):
    """A random mixture of each router kind replay covers: softmax over all experts, renormalised (Qwen3-MoE,
    Qwen3-Next, Qwen3.5-MoE, Mixtral) or not (Qwen2-MoE, OLMoE), and gpt-oss's softmax over the chosen experts'
    logits."""
    torch.manual_seed(0)
    shape = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts_per_tok": 2}  # fmt: skip
    qwen = {"num_experts": 8, "moe_intermediate_size": 16}
    shared = {**qwen, "shared_expert_intermediate_size": 16, "layer_types": ["full_attention"] * layers}
    config = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**shape, **qwen, norm_topk_prob=True),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**shape, **qwen, shared_expert_intermediate_size=16),
        "qwen3_next": lambda: transformers.Qwen3NextConfig(**shape, **shared),
        "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**shape, **shared),
        "olmoe": lambda: transformers.OlmoeConfig(**shape, num_experts=8, eos_token_id=1, pad_token_id=0),
        "mixtral": lambda: transformers.MixtralConfig(**shape, num_local_experts=8),
        "gpt_oss": lambda: transformers.GptOssConfig(**shape, num_local_experts=8, layer_types=["full_attention"] * 2),
    }[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs).float().eval()
    for module in model.modules():  # routers start at zero in some families: spread their choices
        if type(module).__name__.endswith("TopKRouter"):
            torch.nn.init.normal_(module.weight, std=0.5)
    return model


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "olmoe", "mixtral", "gpt_oss"])
def test_replaying_the_routers_own_choice_changes_nothing(kind):
    """Forced to the experts the routers choose themselves, the forward and its gradients are bit-identical to the
    plain ones: replay weighs the experts as each router kind does."""
    model = tiny_mixture(kind)
    routers = Routers.of(model)
    attach(routers)
    ids = torch.randint(0, 32, (2, 9))

    def run(plan):
        model.zero_grad()
        with active(plan):
            logits = model(input_ids=ids).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    recorded = Plan(torch.full((2, 9, len(routers.layers), routers.top_k), -1), replay=False)
    plain_logits, plain_grads = run(recorded)
    replayed_logits, replayed_grads = run(Plan(recorded.live(), replay=True))
    assert torch.equal(plain_logits, replayed_logits)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, replayed_grads, strict=True))
    other = recorded.live().flip(-1).roll(1, -1) + 1  # other experts, in another order
    other_logits, _ = run(Plan(other % routers.experts, replay=True))
    assert not torch.allclose(plain_logits, other_logits)


def test_replay_gradients_match_a_float64_per_token_reference():
    """A float64 Qwen3-MoE block with LoRA on its experts and its router, every token forced to its router's least
    likely expert beside its most likely: the output and the gradients of the LoRA factors (router and experts) match
    a float64 computation token by token — softmax over all experts, taken at the forced ids, renormalised. Gathering
    from the router's top-k scores instead would give the forced expert a weight of 0 and the router no gradient
    through it."""
    from peft import get_peft_model

    base = tiny_mixture("qwen3_moe", layers=1, experts_implementation="eager").double()  # grouped_mm: no float64
    lora = LoraSection(rank=4, alpha=8, target_modules=["all-linear"], train_router=True)
    model = get_peft_model(base, lora_config(lora, base, key="model.lora"))
    generator = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3, generator=generator)
    routers = Routers.of(model)
    attach(routers)
    block = model.get_submodule("base_model.model.model.layers.0.mlp")
    gate = block.gate
    wrapped = {m.parameter_name: m for m in block.experts.modules() if type(m).__name__ == "ParamWrapper"}
    tokens, hidden = 6, base.config.hidden_size
    h = torch.randn(1, tokens, hidden, dtype=torch.float64, generator=generator)
    weight = torch.randn(1, tokens, hidden, dtype=torch.float64, generator=generator)
    with torch.no_grad():
        logits = h[0] @ (gate.get_param() + gate.get_delta_weight("default")).T
    order = logits.argsort(-1, descending=True)
    forced = torch.stack([order[:, 0], order[:, -1]], -1)  # the least likely expert: outside the live top-2
    lora_params = {n: p for n, p in model.named_parameters() if p.requires_grad and ".layers.0.mlp." in n}

    def grads(output):
        model.zero_grad()
        (output * weight).sum().backward()
        return {n: p.grad.clone() for n, p in lora_params.items()}

    with active(Plan(forced[None, :, None], replay=True)):
        ours = block(h)
    got = grads(ours)

    router_w = gate.get_param() + gate.get_delta_weight("default")
    up, down = (wrapped[name].get_param() + wrapped[name].get_delta_weight("default")
                for name in ("gate_up_proj", "down_proj"))  # fmt: skip
    rows = []
    for t in range(tokens):
        probs = torch.softmax(h[0, t] @ router_w.T, -1)
        chosen = probs[forced[t]] / probs[forced[t]].sum()
        out = torch.zeros(hidden, dtype=torch.float64)
        for w, e in zip(chosen, forced[t].tolist(), strict=True):
            g, u = (up[e] @ h[0, t]).chunk(2)
            out = out + w * (down[e] @ (torch.nn.functional.silu(g) * u))
        rows.append(out)
    reference = torch.stack(rows)[None]
    expected = grads(reference)
    # (the router's softmax runs in float32 in any model: replay takes it as the router does)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-8)
    assert any(".gate." in n for n in got)
    assert any("experts" in n for n in got)
    for name in got:
        scale = float(expected[name].abs().max())  # the float32 softmax: within 1e-4 of each gradient's scale
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-4 * scale, msg=name)
        assert got[name].abs().sum() > 0, name


@pytest.fixture(scope="module")
def engine_samples():
    """The embedded mixture's HF engine in bf16 (the trainer's is fp32), recording: 6 prompts x 4 responses."""
    tokenizer = default_task.build_tokenizer()
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in default_task.problems(6, validation=False, seed=3)]
    engine = transformers.AutoModelForCausalLM.from_pretrained(MOE, dtype=torch.bfloat16).eval()
    settings = HFSettings(str(MOE), torch.bfloat16, "cpu", 1, 0, 64, record_routes=True)
    completions = generate_with_hf(engine, settings, 0, prompts, SamplingParams(n=4, max_tokens=8, seed=5))
    return [Sample(list(prompts[c.prompt_index]), c, c.prompt_index, 0.0, 0.0) for c in completions]


@pytest.fixture(scope="module")
def trainer_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(MOE, dtype=torch.float32)
    routers = Routers.of(model)
    attach(routers)
    return model, routers


def expert_inputs(model) -> tuple[list[list[torch.Tensor]], list]:
    """What records the expert ids each MoE layer's experts receive, in the order of the calls (a recompute comes
    after its forward's calls, layer by layer backwards): `seen[layer][c]`; and the hooks' handles."""
    layers = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    seen: list[list[torch.Tensor]] = [[] for _ in layers]

    def record(layer):
        return lambda module, args: seen[layer].append(args[1].detach().clone())

    return seen, [m.register_forward_pre_hook(record(i)) for i, m in enumerate(layers)]


@pytest.mark.parametrize("layout", ["packed", "padded", "shared"])
def test_a_replayed_forward_computes_with_the_recorded_experts_layer_by_layer(engine_samples, trainer_model, layout):
    """Each token's experts in the trainer's forward (as its experts receive them, in the forward and in gradient
    checkpointing's recompute) are the engine's recorded ones, in every layer, in every micro-batch layout — a
    tenth of them changed to other experts, so that the live router would not pick them; without replay it does
    not."""
    model, routers = trainer_model
    generator = np.random.default_rng(0)
    samples = []
    for s in engine_samples:
        routes = s.completion.routes.copy()
        flip = generator.random(routes.shape[0]) < 0.1
        routes[flip] = (routes[flip] + 3) % routers.experts
        samples.append(Sample(s.prompt_ids, Completion(0, s.completion.token_ids, s.completion.logprobs, True, 0,
                                                       routes), s.group, 0.0, 0.0))  # fmt: skip
    routes = sample_routes(samples, routers)
    prompts, responses = [s.prompt_ids for s in samples], [s.completion.token_ids for s in samples]
    width = max(map(len, responses))
    if layout == "shared":  # the first sample of each prompt routes the prompt for all
        for i, s in enumerate(samples):
            first = next(j for j, o in enumerate(samples) if o.prompt_ids == s.prompt_ids)
            routes[i][: len(s.prompt_ids)] = routes[first][: len(s.prompt_ids)]
    seen, handles = expert_inputs(model)
    checkpoint_layers(model)
    try:
        for replay in (True, False):
            for layer in seen:
                layer.clear()
            micro = micro_batch(prompts, responses, width, "cpu", "packed" if layout == "packed" else "padded",
                                share_prompts=layout == "shared", routes=routes, replay=replay)  # fmt: skip
            model.train()
            logp, _ = response_logprobs(model, micro)
            logp.sum().backward()
            calls = [torch.stack(call, 1) for call in zip(*seen, strict=True)]  # [rows x width, layers, k] each
            got = per_sample(calls, samples, layout)
            agree = [torch.equal(ids, routes[i][: len(ids)]) for i, ids in enumerate(got)]
            if replay:
                assert all(agree)
                assert len(calls) == (3 if layout == "shared" else 2)  # the forward's, then its last one's recompute
                assert not rerouted_tokens(micro)[0].any()
                assert rerouted_tokens(micro)[1].any()
            else:
                assert not all(agree)
                assert rerouted_tokens(micro)[0].any()
    finally:
        for handle in handles:
            handle.remove()


def per_sample(stacked: list[torch.Tensor], samples: list[Sample], layout: str) -> list[torch.Tensor]:
    """Each sample's experts `[tokens - 1, layers, k]` as the forward's calls gave them (`stacked`: each call's ids,
    `[rows x width, layers, k]`, the recompute of the last one after them), read back from the layout by hand; the
    recompute must agree with its forward."""
    lengths = [len(s.prompt_ids) + len(s.completion.token_ids) for s in samples]
    out = []
    if layout == "packed":
        starts = np.cumsum([0, *lengths])
        forward, recompute = stacked
        assert torch.equal(forward, recompute)
        return [forward[starts[i] : starts[i] + n - 1] for i, n in enumerate(lengths)]
    if layout == "padded":
        forward, recompute = stacked
        assert torch.equal(forward, recompute)
        rows = forward.view(len(samples), -1, *forward.shape[1:])
        return [rows[i, : n - 1] for i, n in enumerate(lengths)]
    prompts_call, responses_call, recomputed = stacked[0], stacked[1], stacked[-1]
    assert torch.equal(responses_call, recomputed)
    distinct = list(dict.fromkeys(tuple(s.prompt_ids) for s in samples))
    width = max(map(len, distinct))
    prompt_rows = prompts_call.view(len(distinct), width, *prompts_call.shape[1:])
    response_rows = responses_call.view(len(samples), -1, *responses_call.shape[1:])
    for i, s in enumerate(samples):
        prompt = prompt_rows[distinct.index(tuple(s.prompt_ids)), width - len(s.prompt_ids) :]
        out.append(torch.cat([prompt, response_rows[i, : len(s.completion.token_ids) - 1]]))
    return out


def test_a_route_that_cannot_apply_is_refused_naming_its_episode(engine_samples, trainer_model):
    """Routes of another model (other layers), cut short, naming experts the model lacks or missing a layer: one line
    each, naming the episode; a sample without routes where they are needed too."""
    _, routers = trainer_model
    sample = engine_samples[5]
    good = sample.completion.routes
    hole = good.copy()
    hole[:, 1] = -1
    cases = {r"shape \(\d+, 2, 2\)": good[:, :2], "cut": good[:-1], "expert ids up to 8": np.full_like(good, 8),
             r"no experts recorded in layers \[1\]": hole, "no routes": None}  # fmt: skip
    for expected, routes in cases.items():
        bad = Sample(sample.prompt_ids, Completion(0, sample.completion.token_ids, (), True, 0, routes), 2, 0.0, 0.0,
                     episode=7)  # fmt: skip
        with pytest.raises(TrainerError, match=f"episode 7 of the step.*{expected}|{expected}.*episode 7") as e:
            sample_routes([sample, bad], routers)
        assert "\n" not in str(e.value)


def run(tmp_path, *overrides) -> list[dict]:
    out = tmp_path / "out"
    args = ["model.path=default-moe", "actor.lr=3e-4", "trainer.threads=1", "trainer.eval_every=0",
            "data.batch_size=4", "rollout.n=4", f"trainer.output_dir={out}", *overrides]  # fmt: skip
    assert main(args) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


ANOTHER_TURN = '''
from lorarl.trainer.envs.base import Environment, Observation, Step


class AnotherTurn(Environment):
    """After the first action the environment appends "+1=" and the episode goes on; after the second it ends."""

    def reset(self, example):
        self.context, self.turns = tuple(example.prompt_ids), 0
        return Observation(self.context)

    def step(self, action):
        self.turns += 1
        if self.turns == 2:
            return Step(reward=0.0, done=True, stop_reason="second")
        self.context += tuple(action.tokens) + tuple(self.tokenizer.encode("+1="))
        return Step(reward=0.0, observation=Observation(self.context))
'''


def test_routes_travel_through_episodes_and_staleness_and_replay_in_training(tmp_path):
    """The embedded mixture, its engine in bf16 and the trainer in fp32; two-turn episodes whose environment appends
    tokens between the actions (their routes: the second turn's prefill, which read them), a step off-policy
    (`rollout.max_staleness`: the routes wait with their batch), gradient checkpointing on: every route applies (each
    token of each sample has its experts in every layer), the trainer's routers would pick other experts for some
    tokens (`rollout/route_mismatch_live`), the forwards compute with none but the engine's (`rollout/route_mismatch`
    0)."""
    plugin = tmp_path / "another_turn.py"
    plugin.write_text(ANOTHER_TURN)
    records = run(tmp_path, "trainer.steps=3", "rollout.dtype=bfloat16", f"env={plugin}:AnotherTurn",
                  "rollout.max_staleness=1", "algorithm.rollout_correction=token", "algorithm.routing_replay=true",
                  "actor.gradient_checkpointing=true")  # fmt: skip
    steps = [r for r in records if "rollout/route_mismatch" in r]
    assert len(steps) == 3
    assert all(r["env/stop/second"] > 0.5 for r in steps)
    assert all(r["rollout/route_mismatch"] == 0 for r in steps)
    assert all(r[f"rollout/route_mismatch/layer_{i}"] == 0 for r in steps for i in range(3))
    assert any(r["rollout/route_mismatch_live"] > 0 for r in steps)


def test_without_replay_the_mismatch_is_measured_and_a_dense_model_refuses_replay(tmp_path, capsys):
    """Without replay the routes the trainer computes with are its routers' own: the mismatch is theirs. Replay on a
    dense model, or without routes recorded, is refused in one line."""
    records = run(tmp_path, "trainer.steps=2", "rollout.dtype=bfloat16")
    steps = [r for r in records if "rollout/route_mismatch" in r]
    assert all(r["rollout/route_mismatch"] == r["rollout/route_mismatch_live"] for r in steps)
    assert any(r["rollout/route_mismatch"] > 0 and r["rollout/abs_logp_diff_rerouted"] > 0 for r in steps)
    assert main(["model.path=default", "algorithm.routing_replay=true", "trainer.steps=1",
                 f"trainer.output_dir={tmp_path / 'dense'}"]) != 0  # fmt: skip
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1] == "error: algorithm.routing_replay=true: Qwen2ForCausalLM is not a mixture of experts", said
    assert main(["model.path=default-moe", "algorithm.routing_replay=true", "rollout.record_routes=never",
                 f"trainer.output_dir={tmp_path / 'never'}"]) != 0  # fmt: skip
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1] == ("error: algorithm.routing_replay=true: it replays the routes the engine records, and "
                        "rollout.record_routes=never records none"), said
