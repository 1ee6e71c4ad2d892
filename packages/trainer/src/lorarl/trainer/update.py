"""The policy update of one step: advantages from the scored rollouts, then PPO epochs x mini-batches x micro-batches
(gradient accumulation bounded by tokens), each micro-batch's loss composed from the configured algorithm."""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lorarl.trainer import algorithms
from lorarl.trainer.config import Config
from lorarl.trainer.envs import SINGLE_TURN
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.logprobs import MicroBatch, micro_batch, micro_batches, response_logprobs, response_values
from lorarl.trainer.models import Critic, Policy
from lorarl.trainer.optim import Optimizer
from lorarl.trainer.parallel import DataParallel
from lorarl.trainer.rollout import Sample, step_seed
from lorarl.trainer.routing import Routers, differing, route_metrics


@dataclass
class Batch:
    """The step's training batch as tensors `[N]` / `[N, R]`, filled in as the step goes."""

    prompts: list[list[int]]
    responses: list[tuple[int, ...]]
    width: int  # R: the longest response
    sample_lengths: list[int]  # prompt + response tokens (what a micro-batch holds)
    response_mask: torch.Tensor  # every sampled response token (an episode's: its actions, not what its env appended)
    loss_mask: torch.Tensor  # the tokens that get a loss (truncated responses dropped with mask_truncated)
    rollout_logp: torch.Tensor  # the engine's log-probs of the sampled tokens
    rewards: torch.Tensor
    group: torch.Tensor
    baselines: torch.Tensor | None = None  # each prompt's greedy score, where the estimator asks for it
    episode: torch.Tensor | None = None  # multi-turn: each row's episode, where one split into several rows
    reference: torch.Tensor | None = None
    old: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    values: torch.Tensor | None = None  # the critic's, of the rollout (PPO with a critic)
    returns: torch.Tensor | None = None  # what the critic regresses on
    routes: list[torch.Tensor] | None = None  # a mixture's: each sample's experts, int16 [tokens, MoE layers, k]


def to_batch(samples: list[Sample], *, mask_truncated: bool, routers: Routers | None = None) -> Batch:
    """The samples as tensors; with `routers`, their routes checked against the model (`sample_routes`)."""
    responses = [s.completion.token_ids for s in samples]
    lengths = torch.tensor([len(x) for x in responses])
    width = max(1, int(lengths.max()))
    mask = torch.arange(width)[None, :] < lengths[:, None]
    finished = torch.tensor([s.completion.finished for s in samples])
    rollout_logp = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        rollout_logp[i, : len(s.completion.logprobs)] = torch.tensor(s.completion.logprobs)
        if s.action_mask is not None:  # an episode's tokens that its environment appended get no loss
            mask[i, : len(s.action_mask)] &= torch.tensor(s.action_mask, dtype=torch.bool)
    episodes = [s.episode for s in samples]
    return Batch(
        prompts=[s.prompt_ids for s in samples],
        responses=responses,
        width=width,
        sample_lengths=[len(s.prompt_ids) + len(x) for s, x in zip(samples, responses, strict=True)],
        response_mask=mask,
        loss_mask=mask & finished[:, None] if mask_truncated else mask,
        rollout_logp=rollout_logp,
        rewards=torch.tensor([s.reward for s in samples]),
        group=torch.tensor([s.group for s in samples]),
        baselines=None if samples[0].baseline is None else torch.tensor([s.baseline for s in samples]),
        episode=torch.tensor(episodes) if None not in episodes and len(set(episodes)) < len(episodes) else None,
        routes=None if routers is None else sample_routes(samples, routers),
    )


def sample_routes(samples: list[Sample], routers: Routers) -> list[torch.Tensor]:
    """Each sample's route as the trainer's forward reads it: `[tokens, MoE layers, k]` int16 (a micro-batch widens its
    own: a step's routes of Qwen3-30B-A3B take 768 bytes a token so), -1 for the last token
    (no forward read it in the engine); all -1 for a sample without a response. A route that cannot apply, or none
    where the sample has a response, is refused naming its episode (checked all at once, then one by one)."""
    lengths = [len(s.prompt_ids) + len(s.completion.token_ids) for s in samples]
    wheres = [f"episode {s.episode if s.episode is not None else i} of the step (prompt group {s.group})"
              for i, s in enumerate(samples)]  # fmt: skip
    full = np.full((sum(lengths), len(routers.layers), routers.top_k), -1, dtype=np.int16)
    recorded = np.zeros(len(full), dtype=bool)
    start = 0
    for s, tokens, where in zip(samples, lengths, wheres, strict=True):
        route = s.completion.routes
        if route is None and s.completion.token_ids:
            raise TrainerError(f"{where} has no routes: its engine recorded none (rollout.record_routes)")
        if route is not None:
            if route.shape != routers.shape(tokens):
                routers.check(route, tokens, where)
            full[start : start + tokens - 1] = route[:, routers.layers]
            recorded[start : start + tokens - 1] = True
        start += tokens
    ids = full[recorded]
    if ids.size and (ids.min() < 0 or ids.max() >= routers.experts):
        for s, tokens, where in zip(samples, lengths, wheres, strict=True):
            if s.completion.routes is not None:
                routers.check(s.completion.routes, tokens, where)
    return list(torch.from_numpy(full).split(lengths))


def episode_advantages(estimator: algorithms.AdvantageEstimator, batch: Batch, penalty: torch.Tensor | None,
                       settings: dict) -> torch.Tensor:  # fmt: skip
    """Advantages where episodes split into several rows: the estimator sees one row per episode (its last, which
    holds its return), so that group statistics count episodes; every row of the episode gets that row's
    advantage. An estimator whose advantages vary along the tokens (a critic's, discounted returns) needs one
    sequence per episode, and is refused."""
    episode = batch.episode.tolist()
    last = {e: i for i, e in enumerate(episode)}  # the rows of an episode come in order
    rows = list(last.values())
    mask = batch.loss_mask[rows]
    per_row = algorithms.advantages(estimator, batch.rewards[rows], batch.group[rows], mask,
                                    baseline=None if batch.baselines is None else batch.baselines[rows],
                                    values=None if batch.values is None else batch.values[rows],
                                    token_penalty=None if penalty is None else penalty[rows],
                                    **settings)  # fmt: skip
    first = mask.float().argmax(1)
    constant = per_row.gather(1, first[:, None])
    if estimator.needs_values or not torch.equal(per_row * mask, constant * mask):
        raise TrainerError(
            f"algorithm.adv_estimator={estimator.name} gives advantages that vary along an episode's "
            "tokens, and this step's environment split episodes into several sequences (its observations "
            "rewrote the context): use an outcome estimator (grpo, rloo, ...) or an environment whose "
            "observations extend the context"
        )
    by_episode = dict(zip(last, constant[:, 0].tolist(), strict=True))
    values = torch.tensor([by_episode[e] for e in episode], dtype=per_row.dtype)
    return values[:, None] * batch.loss_mask


class ActorUpdate:
    """The step's update of the policy's trainable weights — and of the critic's, with an estimator that uses one
    (`gae`): both train in the same PPO epochs x mini-batches x micro-batches, each with its own optimizer. `layout`
    and `share_prompts` are `logprobs`' micro-batch layout, chosen before the model was sharded."""

    def __init__(self, config: Config, policy: Policy, device: torch.device, dp: DataParallel | None, *, layout: str,
                 share_prompts: bool, critic: Critic | None = None,
                 routers: Routers | None = None) -> None:  # fmt: skip
        self.config, self.policy, self.model, self.device, self.dp = config, policy, policy.model, device, dp
        self.layout, self.share_prompts, self.critic = layout, share_prompts, critic
        self.routers = routers  # a mixture's, where the engine records routes
        algorithm = config.algorithm
        self.estimator = algorithms.ADVANTAGES[algorithm.adv_estimator]
        self.loss = algorithms.POLICY_LOSSES[algorithm.policy_loss]
        self.kl = algorithms.KL_ESTIMATORS[algorithm.kl_estimator]
        self.clip = algorithms.ClipRange(algorithm.clip_low, algorithm.clip_high, algorithm.dual_clip)
        multi_turn = config.env.name != SINGLE_TURN
        self.norm_len = config.env.max_tokens if multi_turn else config.rollout.max_tokens  # a response's most
        a, c, steps = config.actor, config.critic, config.trainer.steps
        self.optimizer = Optimizer(policy.trainable(), lr=a.lr, weight_decay=a.weight_decay, grad_clip=a.grad_clip,
                                   warmup=a.warmup_steps, total=steps, schedule=a.lr_schedule)  # fmt: skip
        self.critic_optimizer = None
        if critic is not None:
            self.critic_optimizer = Optimizer(critic.trainable(), lr=c.lr, weight_decay=c.weight_decay,
                                              grad_clip=c.grad_clip, warmup=0, total=steps,
                                              schedule=a.lr_schedule)  # fmt: skip

    def advantages(self, batch: Batch) -> None:
        """`batch.advantages` by the configured estimator — and what it and the losses need first: the reference
        log-probs (only with a KL term), the old policy's (only when the policy moves within the step), the KL
        subtracted from the rewards (`kl_in_reward`), the critic's values and the returns it regresses on."""
        a = self.config.algorithm
        with torch.no_grad():
            if a.kl_coef > 0:
                batch.reference = self.logprobs(batch, reference=True)
            if a.ppo_epochs > 1 or a.mini_batches > 1:
                batch.old = self.logprobs(batch)
            if self.critic is not None:
                batch.values = self._over_batch(batch, self._values)
        penalty = None
        if batch.reference is not None and a.kl_in_reward:
            current = batch.old if batch.old is not None else self.logprobs(batch)
            penalty = a.kl_coef * self._kl(current, batch.reference) * batch.loss_mask
        settings = self.estimator.configured(a)
        if batch.episode is not None:
            batch.advantages = episode_advantages(self.estimator, batch, penalty, settings)
        else:
            batch.advantages = algorithms.advantages(self.estimator, batch.rewards, batch.group, batch.loss_mask,
                                                     baseline=batch.baselines, values=batch.values,
                                                     token_penalty=penalty, **settings)  # fmt: skip
        if batch.values is not None:  # the critic regresses on the returns of the estimator's discounting
            _, batch.returns = algorithms.gae_returns(batch.rewards, batch.values, batch.loss_mask,
                                                      gamma=settings.get("gamma", 1.0), lam=settings.get("lam", 1.0),
                                                      token_penalty=penalty)  # fmt: skip

    def update(self, step: int, batch: Batch) -> dict:
        """PPO epochs x mini-batches x micro-batches, then the learning-rate schedules' step. The actor waits for the
        first `critic.warmup_steps` steps. Returns the metrics, averaged over the optimizer steps."""
        a = self.config.algorithm
        trains_actor = self.critic is None or step > self.config.critic.warmup_steps
        sums: dict[str, float] = {}
        generator = torch.Generator().manual_seed(step_seed(self.config.trainer.seed, step))
        order = torch.randperm(len(batch.prompts), generator=generator)
        seen_old = torch.zeros_like(batch.rollout_logp)  # π_old of every sample, for the mismatch metrics
        layers = len(self.routers.layers) if batch.routes is not None else 0
        seen_routes = torch.zeros(2, *batch.rollout_logp.shape, layers)  # the trainer's experts not the engine's
        self.model.train()
        for epoch in range(a.ppo_epochs):
            for minibatch in torch.tensor_split(order, a.mini_batches):
                minibatch = minibatch.tolist()
                totals = {
                    "total_tokens": float(batch.loss_mask[minibatch].sum().clamp(min=1)),
                    "total_sequences": float(batch.loss_mask[minibatch].any(1).sum()),  # those with a loss
                    "norm_len": self.norm_len,  # Dr. GRPO's constant length
                }
                for micro in self._micro_batches(batch, minibatch):
                    rows = micro or minibatch[:1]  # None: this rank has no rows left; run one with zero weight
                    # FSDP averages the ranks' gradients: scale by the world size to sum them instead
                    weight = 0.0 if micro is None else float(self.dp.world if self.dp is not None else 1)
                    share = float(batch.loss_mask[rows].sum()) / totals["total_tokens"] if micro else 0.0
                    info = {}
                    if trains_actor:
                        loss, info, old_logp, forward = self._loss(batch, rows, totals)
                        (loss * weight).backward()
                        if micro and epoch == 0:
                            seen_old[rows] = old_logp.cpu()
                            if forward.routes is not None:
                                seen_routes[:, rows] = rerouted_tokens(forward).cpu().float()
                        info["loss"] = float(loss.detach()) / share if share else 0.0
                    if self.critic is not None:
                        loss, critic_info = self._value_loss(batch, rows, totals)
                        (loss * weight).backward()
                        info.update(critic_info)
                        info["critic/vf_loss"] = float(loss.detach()) / share if share else 0.0
                    for key, value in info.items():
                        sums[key] = sums.get(key, 0.0) + value * share
                if trains_actor:
                    sums["grad_norm"] = sums.get("grad_norm", 0.0) + self.optimizer.step()
                if self.critic is not None:
                    sums["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) + self.critic_optimizer.step()
        for optimizer in (self.optimizer if trains_actor else None, self.critic_optimizer):
            if optimizer is not None:
                optimizer.scheduler.step()
        steps = a.ppo_epochs * a.mini_batches
        if self.dp is not None:  # each rank summed its share of every mini-batch (the norms are the same on each)
            norms = {key: sums.pop(key) for key in ("grad_norm", "critic/grad_norm") if key in sums}
            sums, seen_old = {**self.dp.sum_metrics(sums), **norms}, self.dp.sum(seen_old)
            seen_routes = self.dp.sum(seen_routes) if layers else seen_routes
        metrics = {key: value / steps for key, value in sums.items()}
        if trains_actor:
            metrics.update(algorithms.rollout_mismatch(seen_old, batch.rollout_logp, batch.response_mask))
            if layers:
                metrics.update(route_metrics(seen_routes[0].bool(), seen_routes[1].bool(), self.routers.layers,
                                             seen_old, batch.rollout_logp, batch.response_mask))  # fmt: skip
        if self.critic is not None:
            metrics.update(critic_metrics(batch, self.critic_optimizer.lr))
        return metrics

    def _loss(self, batch: Batch, rows: list[int],
              totals: dict) -> tuple[torch.Tensor, dict, torch.Tensor, MicroBatch]:  # fmt: skip
        """One micro-batch's loss — the policy loss (rollout-corrected), plus the KL and entropy terms configured —
        its metrics, the old log-probs it used, and the micro-batch it ran (with routes recorded, what its routers
        chose: `rerouted_tokens`)."""
        a = self.config.algorithm
        micro = self._micro_batch(batch, rows)
        with self.compute():
            logp, entropy = response_logprobs(self.model, micro, temperature=self.config.rollout.temperature,
                                              entropy_grad=bool(a.entropy_coef))  # fmt: skip
        mask = batch.loss_mask[rows].to(self.device)
        old_logp = batch.old[rows].to(self.device) if batch.old is not None else logp.detach()
        is_weights = None
        if a.rollout_correction != "none":
            is_weights = algorithms.rollout_is_weights(old_logp, batch.rollout_logp[rows].to(self.device), mask,
                                                       a.rollout_correction, a.rollout_correction_cap,
                                                       tuple(a.rollout_correction_band))  # fmt: skip
        loss, info = algorithms.policy_loss(self.loss, logp, old_logp, batch.advantages[rows].to(self.device), mask,
                                            clip=self.clip, loss_agg_mode=a.loss_agg_mode, is_weights=is_weights,
                                            settings=self.loss.settings_in(a), **totals)  # fmt: skip
        tokens = mask.sum().clamp(min=1)
        if is_weights is not None:
            info["rollout/is_weight_mean"] = float(is_weights.sum() / tokens)
        if batch.reference is not None:
            kl = self._kl(logp, batch.reference[rows].to(self.device))
            info["kl"] = float((kl.detach() * mask).sum() / tokens)
            if not a.kl_in_reward:
                loss = loss + a.kl_coef * algorithms.aggregate(kl, mask, a.loss_agg_mode, **totals)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * algorithms.aggregate(entropy, mask, a.loss_agg_mode, **totals)
        info["entropy"] = float((entropy.detach() * mask).sum() / tokens)
        return loss, info, old_logp, micro

    def _kl(self, logp: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        return algorithms.kl_penalty(logp, reference, self.kl, self.kl.settings_in(self.config.algorithm))

    def _micro_batches(self, batch: Batch, indices: list[int]) -> list[list[int] | None]:
        """This rank's micro-batches over its share of `indices` (token-bounded); with data parallelism padded with
        None to the count of the rank that has the most, so that every rank runs the same number of forwards."""
        limit = self.config.actor.micro_batch_tokens

        def split(rows: list[int]) -> list[list[int]]:
            lengths = [batch.sample_lengths[r] for r in rows]
            return [[rows[i] for i in m] for m in micro_batches(lengths, limit, self.layout)]

        if self.dp is None:
            return split(indices)
        shares = [split(self.dp.rows(indices, rank)) for rank in range(self.dp.world)]
        mine = shares[self.dp.rank]
        return mine + [None] * (max(map(len, shares)) - len(mine))

    def _micro_batch(self, batch: Batch, rows: list[int]):
        routes = None if batch.routes is None else [batch.routes[i] for i in rows]
        return micro_batch([batch.prompts[i] for i in rows], [batch.responses[i] for i in rows], batch.width,
                           self.device, self.layout, share_prompts=self.share_prompts, routes=routes,
                           replay=self.config.algorithm.routing_replay)  # fmt: skip

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """`[N, R]` log-probs of every response under the current policy (or the reference), no gradient."""
        temperature = self.config.rollout.temperature
        with self.policy.reference() if reference else contextlib.nullcontext(self.model) as model, self.compute():
            return self._over_batch(batch, lambda micro: response_logprobs(model, micro, temperature=temperature)[0])

    def _values(self, micro: MicroBatch) -> torch.Tensor:
        with self.critic.selected() as model, self.compute():
            return response_values(model, micro, self.critic.head)

    def compute(self) -> contextlib.AbstractContextManager:
        """The forwards (and so the backwards) in `actor.autocast`'s dtype, or as the weights are."""
        name = self.config.actor.autocast
        if name == "none":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, name))

    def _value_loss(self, batch: Batch, rows: list[int], totals: dict) -> tuple[torch.Tensor, dict]:
        """One micro-batch's clipped value loss against the returns, aggregated as the policy loss is."""
        on_device = {name: getattr(batch, name)[rows].to(self.device) for name in ("values", "returns", "loss_mask")}
        values = self._values(self._micro_batch(batch, rows))
        return algorithms.value_loss(values, on_device["values"], on_device["returns"], on_device["loss_mask"],
                                     clip=self.config.critic.cliprange_value,
                                     loss_agg_mode=self.config.algorithm.loss_agg_mode, **totals)  # fmt: skip

    def _over_batch(self, batch: Batch, forward: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
        """`[N, R]`: `forward` of every micro-batch of the whole batch in eval mode (each rank its share, summed)."""
        values = torch.zeros(len(batch.prompts), batch.width)
        self.model.eval()
        for micro in self._micro_batches(batch, list(range(len(batch.prompts)))):
            rows = micro or [0]  # None: a forward for the collectives only
            computed = forward(self._micro_batch(batch, rows)).cpu()
            if micro:
                values[rows] = computed
        return self.dp.sum(values) if self.dp is not None else values


def rerouted_tokens(micro: MicroBatch) -> torch.Tensor:
    """`[2, B, R, layers]` bool, per response token and MoE layer: whether the experts at the position that predicts it
    were not the engine's — those the forward computed with, then those its routers chose themselves."""
    engine = micro.per_token([plan.forced for plan in micro.routes])
    return torch.stack([differing(engine, micro.per_token([plan.used() for plan in micro.routes])),
                        differing(engine, micro.per_token([plan.live() for plan in micro.routes]))])


def critic_metrics(batch: Batch, lr: float) -> dict:
    """How well the critic's values (those of the rollout) predict the returns."""
    mask = batch.loss_mask
    tokens = mask.sum().clamp(min=1)
    return {
        "critic/values_mean": float((batch.values * mask).sum() / tokens),
        "critic/returns_mean": float((batch.returns * mask).sum() / tokens),
        "critic/vf_explained_var": algorithms.explained_variance(batch.values, batch.returns, mask),
        "critic/lr": lr,
    }
