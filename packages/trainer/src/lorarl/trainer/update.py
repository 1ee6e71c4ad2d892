"""The policy update of one step: advantages from the scored rollouts, then PPO epochs x mini-batches x micro-batches
(gradient accumulation bounded by tokens), each micro-batch's loss composed from the configured algorithm."""

import contextlib
import math
from dataclasses import dataclass

import torch

from lorarl.trainer import algorithms
from lorarl.trainer.config import Config
from lorarl.trainer.logprobs import micro_batch, micro_batches, response_logprobs
from lorarl.trainer.models import Policy
from lorarl.trainer.parallel import DataParallel
from lorarl.trainer.rollout import Sample, step_seed


@dataclass
class Batch:
    """The step's training batch as tensors `[N]` / `[N, R]`, filled in as the step goes."""

    prompts: list[list[int]]
    responses: list[tuple[int, ...]]
    width: int  # R: the longest response
    sample_lengths: list[int]  # prompt + response tokens (what a micro-batch holds)
    response_mask: torch.Tensor  # every response token
    loss_mask: torch.Tensor  # the tokens that get a loss (truncated responses dropped with mask_truncated)
    rollout_logp: torch.Tensor  # the engine's log-probs of the sampled tokens
    rewards: torch.Tensor
    group: torch.Tensor
    baselines: torch.Tensor | None = None  # each prompt's greedy score, where the estimator asks for it
    reference: torch.Tensor | None = None
    old: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


def to_batch(samples: list[Sample], *, mask_truncated: bool) -> Batch:
    responses = [s.completion.token_ids for s in samples]
    lengths = torch.tensor([len(x) for x in responses])
    width = max(1, int(lengths.max()))
    mask = torch.arange(width)[None, :] < lengths[:, None]
    finished = torch.tensor([s.completion.finished for s in samples])
    rollout_logp = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        rollout_logp[i, : len(s.completion.logprobs)] = torch.tensor(s.completion.logprobs)
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
    )


class ActorUpdate:
    """The optimizer and schedule of the policy's trainable weights, and the step's update of them. `layout` and
    `share_prompts` are `logprobs`' micro-batch layout, chosen before the model was sharded."""

    def __init__(self, config: Config, policy: Policy, device: torch.device, dp: DataParallel | None, *, layout: str,
                 share_prompts: bool) -> None:  # fmt: skip
        self.config, self.policy, self.model, self.device, self.dp = config, policy, policy.model, device, dp
        self.layout, self.share_prompts = layout, share_prompts
        a = config.actor
        self.optimizer = torch.optim.AdamW(policy.trainable, lr=a.lr, weight_decay=a.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(a.warmup_steps, config.trainer.steps, a.lr_schedule)
        )

    def advantages(self, batch: Batch) -> None:
        """`batch.advantages` by the configured estimator — and what it and the loss need first: the reference
        log-probs (only with a KL term), the old policy's (only when the policy moves within the step), the KL
        subtracted from the rewards (`kl_in_reward`)."""
        a = self.config.algorithm
        with torch.no_grad():
            if a.kl_coef > 0:
                batch.reference = self.logprobs(batch, reference=True)
            if a.ppo_epochs > 1 or a.mini_batches > 1:
                batch.old = self.logprobs(batch)
        rewards = batch.rewards
        if batch.reference is not None and a.kl_in_reward:
            current = batch.old if batch.old is not None else self.logprobs(batch)
            kl = algorithms.kl_penalty(current, batch.reference, a.kl_estimator)
            rewards = rewards - a.kl_coef * (kl * batch.loss_mask).sum(1)
        batch.advantages = algorithms.advantages(a.adv_estimator, rewards, batch.group, batch.loss_mask,
                                                 norm_std=a.norm_std, gamma=a.gamma,
                                                 baseline=batch.baselines)  # fmt: skip

    def update(self, step: int, batch: Batch) -> dict:
        """PPO epochs x mini-batches x micro-batches, then the learning-rate schedule's step. Returns the metrics,
        averaged over the optimizer steps."""
        a = self.config.algorithm
        sums: dict[str, float] = {}
        grad_norm = 0.0
        generator = torch.Generator().manual_seed(step_seed(self.config.trainer.seed, step))
        order = torch.randperm(len(batch.prompts), generator=generator)
        seen_old = torch.zeros_like(batch.rollout_logp)  # π_old of every sample, for the mismatch metrics
        self.model.train()
        for epoch in range(a.ppo_epochs):
            for minibatch in torch.tensor_split(order, a.mini_batches):
                minibatch = minibatch.tolist()
                totals = {
                    "total_tokens": float(batch.loss_mask[minibatch].sum().clamp(min=1)),
                    "total_sequences": float(batch.loss_mask[minibatch].any(1).sum()),  # those with a loss
                    "norm_len": self.config.rollout.max_tokens,  # Dr. GRPO's constant length
                }
                for micro in self._micro_batches(batch, minibatch):
                    rows = micro or minibatch[:1]  # None: this rank has no rows left; run one with zero weight
                    loss, info, old_logp = self._loss(batch, rows, totals)
                    if micro is None:
                        (loss * 0.0).backward()
                        continue
                    if epoch == 0:
                        seen_old[rows] = old_logp.cpu()
                    (loss * self.dp.world if self.dp is not None else loss).backward()  # FSDP averages: sum instead
                    share = float(batch.loss_mask[rows].sum()) / totals["total_tokens"]
                    info["loss"] = float(loss.detach()) / share if share else 0.0
                    for key, value in info.items():
                        sums[key] = sums.get(key, 0.0) + value * share
                grad_norm += float(self._optimizer_step())
        self.scheduler.step()
        steps = a.ppo_epochs * a.mini_batches
        if self.dp is not None:  # each rank summed its share of every mini-batch
            sums, seen_old = self.dp.sum_metrics(sums), self.dp.sum(seen_old)
        metrics = {key: value / steps for key, value in sums.items()}
        metrics["grad_norm"] = grad_norm / steps
        metrics.update(algorithms.rollout_mismatch(seen_old, batch.rollout_logp, batch.response_mask))
        return metrics

    def _loss(self, batch: Batch, rows: list[int], totals: dict) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """One micro-batch's loss — the policy loss (rollout-corrected), plus the KL and entropy terms configured —
        its metrics, and the old log-probs it used."""
        a = self.config.algorithm
        logp, entropy = response_logprobs(self.model, self._micro_batch(batch, rows),
                                          temperature=self.config.rollout.temperature,
                                          entropy_grad=bool(a.entropy_coef))  # fmt: skip
        mask = batch.loss_mask[rows].to(self.device)
        old_logp = batch.old[rows].to(self.device) if batch.old is not None else logp.detach()
        is_weights = None
        if a.rollout_correction != "none":
            is_weights = algorithms.rollout_is_weights(old_logp, batch.rollout_logp[rows].to(self.device), mask,
                                                       a.rollout_correction, a.rollout_correction_cap,
                                                       tuple(a.rollout_correction_band))  # fmt: skip
        loss, info = algorithms.policy_loss(a.policy_loss, logp, old_logp, batch.advantages[rows].to(self.device),
                                            mask, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                                            loss_agg_mode=a.loss_agg_mode, is_weights=is_weights,
                                            options=loss_options(a), **totals)  # fmt: skip
        tokens = mask.sum().clamp(min=1)
        if is_weights is not None:
            info["rollout/is_weight_mean"] = float(is_weights.sum() / tokens)
        if batch.reference is not None:
            kl = algorithms.kl_penalty(logp, batch.reference[rows].to(self.device), a.kl_estimator)
            info["kl"] = float((kl.detach() * mask).sum() / tokens)
            if not a.kl_in_reward:
                loss = loss + a.kl_coef * algorithms.aggregate(kl, mask, a.loss_agg_mode, **totals)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * algorithms.aggregate(entropy, mask, a.loss_agg_mode, **totals)
        info["entropy"] = float((entropy.detach() * mask).sum() / tokens)
        return loss, info, old_logp

    def _optimizer_step(self) -> torch.Tensor:
        clip = self.config.actor.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable, clip if clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded: the norm over all ranks

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
        return micro_batch([batch.prompts[i] for i in rows], [batch.responses[i] for i in rows], batch.width,
                           self.device, self.layout, share_prompts=self.share_prompts)  # fmt: skip

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """`[N, R]` log-probs of every response under the current policy (or the reference), no gradient."""
        temperature = self.config.rollout.temperature
        values = torch.zeros(len(batch.prompts), batch.width)
        with self.policy.reference() if reference else contextlib.nullcontext(self.model) as model:
            model.eval()
            for micro in self._micro_batches(batch, list(range(len(batch.prompts)))):
                rows = micro or [0]  # None: a forward for the collectives only
                logp = response_logprobs(model, self._micro_batch(batch, rows), temperature=temperature)[0].cpu()
                if micro:
                    values[rows] = logp
        return self.dp.sum(values) if self.dp is not None else values


def loss_options(a) -> dict:
    """The `algorithm` keys the registered policy losses take besides the clip range."""
    names = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef", "sapo_tau_pos",
             "sapo_tau_neg")  # fmt: skip
    return {name: getattr(a, name) for name in names}


def lr_factor(warmup: int, total: int, schedule: str):
    """The learning rate's multiplier at each optimizer step: linear warmup, then constant or cosine to 0."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor
