"""The training loop: rollouts -> rewards -> advantages -> policy update -> merged weights into the engine."""

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from lorarl.lora_merge import iter_merged_weights, merged_weight_specs
from lorarl.trainer import algorithms, checkpoint, data, rewards
from lorarl.trainer.config import Config, to_yaml
from lorarl.trainer.engine import Completion, EngineError, InlineEngine, ProcessEngine, RolloutEngine, hf_settings
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.logprobs import micro_batch, micro_batches, resolve_layout, response_logprobs, scores_from_hidden
from lorarl.trainer.metrics import MetricsLog, plot
from lorarl.trainer.models import Policy, load_tokenizer, rollout_dtype
from lorarl.trainer.parallel import full_state_dict, setup_data_parallel, shard


class Trainer:
    def __init__(self, config: Config, *, console=None):
        self.config = config
        self.console = console
        t = config.trainer
        self.output_dir = Path(t.output_dir or f"outputs/{datetime.now():%Y%m%d-%H%M%S}")
        _seed_everything(t.seed)
        self.device = torch.device("cuda" if t.device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if t.device == "auto" else t.device))  # fmt: skip
        if config.rollout.replicas > 1 and t.backend != "ray":
            raise TrainerError(f"rollout.replicas={config.rollout.replicas} needs trainer.backend=ray")
        if config.rollout.overlap and config.algorithm.rollout_correction == "none":
            raise TrainerError("rollout.overlap trains on rollouts of the weights one update behind: set "
                               "algorithm.rollout_correction=token (or sequence) to correct for that")  # fmt: skip
        if config.rollout.overlap and config.rollout.engine == "hf" and config.rollout.worker == "inline":
            raise TrainerError("rollout.overlap generates beside the training: it needs rollout.worker=process")
        self.dp, self.device = setup_data_parallel(self.device)
        self.policy = Policy(config.model, self.device, kl_coef=config.algorithm.kl_coef)
        self.rollout_dtype = rollout_dtype(config.rollout.dtype, self.policy.dtype, self.device)
        self.model = self.policy.model
        self.layout = resolve_layout(config.actor.layout, self.model)  # before sharding renames the classes
        # a GRPO group's responses share their prompt: run it once (padded layout, log-probs from the hidden states)
        self.share_prompts = self.layout == "padded" and config.rollout.n > 1 and scores_from_hidden(self.model)
        resume_from = self._checkpoint_to_resume()
        if resume_from is not None:  # before sharding: every rank reads the full weights
            checkpoint.load_weights(resume_from, self.model, is_lora=self.policy.is_lora)
        if self.dp is not None:
            shard(self.model, self.dp.mesh)
            self.policy.trainable = [p for p in self.model.parameters() if p.requires_grad]  # now sharded
        self.tokenizer = load_tokenizer(self.policy.path)
        self.train_set, dropped = self._examples(config.data.train_files, "train.jsonl")
        self.val_set, val_dropped = self._examples(config.data.val_files, "val.jsonl")
        if config.data.val_size:
            self.val_set = self.val_set[: config.data.val_size]
        self.dropped = {"train": dropped, "val": val_dropped}
        self.reward_fn = rewards.load_reward(config.reward.fn)
        self.sampler = data.PromptSampler(len(self.train_set), config.data.batch_size, t.seed)
        a = config.actor
        self.optimizer = torch.optim.AdamW(self.policy.trainable, lr=a.lr, weight_decay=a.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_factor(a.warmup_steps, t.steps, a.lr_schedule)
        )
        self._prefetched: tuple[list[int], list[Completion]] | None = None  # the next step's batch (rollout.overlap)
        self.start_step = self._resume(resume_from)
        self.engine: RolloutEngine | None = None
        self.version = self.start_step
        self.sync_mode = config.rollout.sync  # "auto" is settled by measuring, before the first step

    # --- setup ---------------------------------------------------------------------------------------------------

    def _examples(self, files: list[str], default_file: str) -> tuple[list[data.Example], int]:
        d = self.config.data
        rows = data.read_rows(files, default_file=default_file)
        examples, dropped = data.build_examples(
            rows,
            self.tokenizer,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            max_prompt_tokens=d.max_prompt_tokens,
            chat_template=d.chat_template,
        )
        if not examples:
            raise TrainerError(f"no usable prompts in {files}: {len(rows)} rows, {dropped} longer than "
                               f"data.max_prompt_tokens={d.max_prompt_tokens}")  # fmt: skip
        return examples, dropped

    def _checkpoint_to_resume(self) -> Path | None:
        resume = self.config.trainer.resume
        if resume == "never":
            return None
        path = checkpoint.latest(self.output_dir) if resume == "auto" else Path(resume)
        if path is not None and not (path / checkpoint.STATE).is_file():
            raise TrainerError(f"trainer.resume={resume!r}: {path} is not a checkpoint")
        return path  # None: auto, nothing to resume from (a fresh run)

    def _resume(self, path: Path | None) -> int:
        """The optimizer, scheduler, data position and RNG of the checkpoint whose weights are loaded already."""
        if path is None:
            return 0
        state = checkpoint.load_state(path)
        checkpoint.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self._prefetched = state.get("prefetched")
        self._say(f"resumed from {path} (step {state['step']})")
        return state["step"]

    def _start_engine(self) -> RolloutEngine:
        r, t = self.config.rollout, self.config.trainer
        if r.sync != "merged" and not self.policy.is_lora:
            raise TrainerError(f"rollout.sync={r.sync} needs a LoRA adapter (model.lora.rank > 0)")
        if r.engine == "vllm":
            from lorarl.trainer.vllm_engine import vllm_settings

            adapter_rank = self.model.peft_config["default"].r if r.sync != "merged" else None
            settings = vllm_settings(self.policy.path, dtype=self.rollout_dtype, seed=t.seed, devices=r.devices,
                                     tensor_parallel_size=r.tensor_parallel_size, max_model_len=r.max_model_len,
                                     gpu_memory_utilization=r.gpu_memory_utilization,
                                     adapter_rank=adapter_rank)  # fmt: skip
        else:
            # generating on the CPU beside the training (rollout.overlap): one core, so the two do not oversubscribe
            threads = 1 if r.overlap and self.device.type == "cpu" else None
            settings = hf_settings(self.policy.path, dtype=self.rollout_dtype, device=str(self.device),
                                   eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                                   batch_size=r.batch_size, threads=threads)  # fmt: skip
        if r.engine == "vllm" and t.backend == "local" and r.devices is None:
            from lorarl.trainer.vllm_engine import ColocatedVllmEngine

            return ColocatedVllmEngine.start(settings, bucket_bytes=r.bucket_mb << 20)
        if t.backend == "ray":
            from lorarl.trainer.ray_engine import RayEngines

            return RayEngines(settings, replicas=r.replicas, bucket_bytes=r.bucket_mb << 20, address=t.ray_address)
        if r.engine == "hf" and r.worker == "inline":
            return InlineEngine(settings)
        return ProcessEngine(settings, bucket_bytes=r.bucket_mb << 20)

    # --- the run -------------------------------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """The rank that owns the engine, the logs and the checkpoints (the only one without data parallelism)."""
        return self.dp is None or self.dp.is_main

    def run(self) -> dict:
        t = self.config.trainer
        if not self.is_main:
            return self._follow()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(to_yaml(self.config))
        self._say(f"outputs: {self.output_dir.resolve()}")
        if any(self.dropped.values()):
            self._say(f"dropped prompts longer than {self.config.data.max_prompt_tokens} tokens: {self.dropped}")
        log = MetricsLog(self.output_dir, resume_step=self.start_step)
        self.engine = self._start_engine()
        try:
            with self._progress_bar() as progress:
                chosen = self._choose_sync() if self.config.rollout.sync == "auto" else {}
                if chosen:
                    self._say(_sync_choice(chosen), progress)
                self._sync()  # the engine starts from disk: give it this run's weights (an adapter, a resumed state)
                first_eval = self.evaluate() if t.eval_every else {}
                if (first_eval or chosen) and self.start_step == 0:
                    log.log(0, {**chosen, **first_eval})
                if first_eval and self.start_step == 0:
                    self._say(f"step 0: validation accuracy {first_eval['val/accuracy']:.3f}", progress)
                for step in range(self.start_step + 1, t.steps + 1):
                    metrics = self.train_step(step)
                    if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                        metrics.update(self.evaluate())
                        self._say(_line(step, t.steps, metrics), progress)
                    log.log(step, metrics)
                    if progress is not None:
                        progress.update(progress.task_ids[0], completed=step, status=_status(metrics))
                    if self._saves_at(step):
                        self.save(step)
        finally:
            self.engine.close()
            log.close()
        plots = plot(log.path, self.output_dir / "plots")
        summary = _summary(log.path, first_eval)
        summary.update({"output_dir": str(self.output_dir), "plots": [str(p) for p in plots]})
        return summary

    def _follow(self) -> dict:
        """A data-parallel rank other than 0: the same steps, its share of the training, the collectives."""
        t = self.config.trainer
        if self.config.rollout.sync == "auto":
            self._choose_sync()
        self._sync()
        for step in range(self.start_step + 1, t.steps + 1):
            self.train_step(step)
            if self._saves_at(step):
                self.save(step)
        return {}

    def _saves_at(self, step: int) -> bool:
        """A checkpoint every `trainer.save_every` steps, and at the end."""
        t = self.config.trainer
        return bool(t.save_every and step % t.save_every == 0) or step == t.steps

    def train_step(self, step: int) -> dict:
        a = self.config.algorithm
        started = time.perf_counter()
        samples, metrics = self._collect(step) if self.is_main else (None, None)
        if self.dp is not None:
            samples, metrics = self.dp.broadcast((samples, metrics))
        rollout_s = time.perf_counter() - started
        next_batch = None
        if self.config.rollout.overlap and self.is_main:  # at the last step too: a checkpoint keeps it for resuming
            next_batch = self._request(step + 1, 0)  # generated on this step's weights while the trainer trains
        if hasattr(self.engine, "sleep"):  # a colocated engine gives the GPU back while the trainer trains
            self.engine.sleep()

        train_started = time.perf_counter()
        batch = _batch(samples, mask_truncated=a.mask_truncated)
        with torch.no_grad():
            if a.kl_coef > 0:  # the reference forward only where a KL term uses it
                batch.reference = self._logprobs_all(batch, reference=True)
            if a.ppo_epochs > 1 or a.mini_batches > 1:
                batch.old = self._logprobs_all(batch)
        rewards = batch.rewards
        if batch.reference is not None and a.kl_in_reward:
            current = batch.old if batch.old is not None else self._logprobs_all(batch)
            kl = algorithms.kl_penalty(current, batch.reference, a.kl_estimator)
            rewards = rewards - a.kl_coef * (kl * batch.loss_mask).sum(1)
        batch.advantages = algorithms.advantages(a.adv_estimator, rewards, batch.group, batch.loss_mask,
                                                 norm_std=a.norm_std, gamma=a.gamma)  # fmt: skip
        metrics.update(self._update(step, batch))
        self.scheduler.step()
        train_s = time.perf_counter() - train_started

        if next_batch is not None:  # before the sync: the engine answers in order
            waited = time.perf_counter()
            indices, wait = next_batch
            self._prefetched = (indices, wait())
            rollout_s += time.perf_counter() - waited
        sync_started = time.perf_counter()
        stats = self._sync(version=step)
        sync_s = time.perf_counter() - sync_started
        return {
            **metrics,
            "lr": self.scheduler.get_last_lr()[0],
            "data/epoch": self.sampler.epoch,
            "timing/rollout_s": rollout_s,
            "timing/train_s": train_s,
            "timing/sync_s": sync_s,
            "timing/step_s": time.perf_counter() - started,
            "sync/bytes": stats.bytes if stats is not None else 0,
        }

    def _collect(self, step: int) -> tuple[list["Sample"], dict]:
        """Rollouts of a batch of prompts, scored. With dynamic sampling (DAPO), groups whose rewards all agree are
        dropped and more prompts are drawn until `data.batch_size` groups are kept or `max_sampling_rounds` is
        reached; then the step trains on what was kept (on the last round's samples if nothing was)."""
        a, batch_size = self.config.algorithm, self.config.data.batch_size
        drawn, kept, groups = [], [], 0
        rounds = a.max_sampling_rounds if a.dynamic_sampling else 1
        for round_ in range(rounds):
            samples = self._generate(step, round_, first_group=groups)
            groups += len({s.group for s in samples})
            drawn += samples
            if not a.dynamic_sampling:
                kept = samples
                break
            informative = algorithms.informative_groups(torch.tensor([s.reward for s in samples]),
                                                        torch.tensor([s.group for s in samples]))  # fmt: skip
            kept += [s for s, keep in zip(samples, informative.tolist(), strict=True) if keep]
            if len({s.group for s in kept}) >= batch_size:
                break
        metrics = _rollout_metrics(drawn)
        if a.dynamic_sampling:
            chosen = set(sorted({s.group for s in kept})[:batch_size])
            kept = [s for s in kept if s.group in chosen] or samples
            metrics.update({"sampling/rounds": round_ + 1, "sampling/prompts": groups,
                            "sampling/kept_groups": len(chosen)})  # fmt: skip
        metrics["rollout/version_lag"] = max(self.version - s.completion.version for s in kept)
        return kept, metrics

    def _request(self, step: int, round_: int) -> tuple[list[int], Callable[[], list[Completion]]]:
        """The next batch of prompts from the sampler, submitted to the engine: their indices, and what waits for
        the completions."""
        r = self.config.rollout
        indices = self.sampler.next_batch()
        wait = self.engine.submit([self.train_set[i].prompt_ids for i in indices], n=r.n, temperature=r.temperature,
                                  top_p=r.top_p, max_tokens=r.max_tokens,
                                  seed=_step_seed(self.config.trainer.seed, step, round_))  # fmt: skip
        return indices, wait

    def _generate(self, step: int, round_: int, first_group: int) -> list["Sample"]:
        """One batch of prompts, `rollout.n` responses each (generated during the last step with `rollout.overlap`),
        scored (and overlong-shaped)."""
        r, a = self.config.rollout, self.config.algorithm
        if round_ == 0 and self._prefetched is not None:
            (indices, completions), self._prefetched = self._prefetched, None
        else:
            indices, wait = self._request(step, round_)
            completions = wait()
        self._check_versions(completions)
        examples = [self.train_set[i] for i in indices]
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        chosen = [examples[c.prompt_index] for c in completions]
        scores = rewards.score(self.reward_fn, [e.prompt for e in chosen], texts, [e.answer for e in chosen])
        penalties = [0.0] * len(completions)
        if a.overlong_buffer_frac > 0:
            buffer = max(1, round(a.overlong_buffer_frac * r.max_tokens))
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            penalties = algorithms.overlong_penalty(lengths, r.max_tokens, buffer, a.overlong_penalty).tolist()
        return [Sample(list(e.prompt_ids), c, first_group + c.prompt_index, score, score + penalty)
                for e, c, score, penalty in zip(chosen, completions, scores, penalties, strict=True)]  # fmt: skip

    def _update(self, step: int, batch: "Batch") -> dict:
        """PPO epochs x mini-batches x micro-batches (gradient accumulation bounded by tokens)."""
        a = self.config.algorithm
        temperature = self.config.rollout.temperature
        sums: dict[str, float] = {}
        grad_norm = 0.0
        order = torch.randperm(
            len(batch.prompts), generator=torch.Generator().manual_seed(_step_seed(self.config.trainer.seed, step))
        )
        seen_old = torch.zeros_like(batch.rollout_logp)  # π_old of every sample, for the mismatch metrics
        self.model.train()
        for epoch in range(a.ppo_epochs):
            for minibatch in torch.tensor_split(order, a.mini_batches):
                minibatch = minibatch.tolist()
                totals = {
                    "total_tokens": float(batch.loss_mask[minibatch].sum().clamp(min=1)),
                    "total_sequences": float(len(minibatch)),
                    "norm_len": self.config.rollout.max_tokens,  # Dr. GRPO's constant length
                }
                for micro in self._micro_batches(batch, minibatch):
                    rows = micro or minibatch[:1]  # None: this rank has no rows left; run one with zero weight
                    micro_inputs = self._micro_batch(batch, rows)
                    logp, entropy = response_logprobs(self.model, micro_inputs, temperature=temperature,
                                                      entropy_grad=bool(a.entropy_coef))  # fmt: skip
                    m = batch.loss_mask[rows].to(self.device)
                    old_logp = batch.old[rows].to(self.device) if batch.old is not None else logp.detach()
                    if epoch == 0 and micro:
                        seen_old[rows] = old_logp.cpu()
                    is_weights = None
                    if a.rollout_correction != "none":
                        rollout_logp = batch.rollout_logp[rows].to(self.device)
                        is_weights = algorithms.rollout_is_weights(old_logp, rollout_logp, m, a.rollout_correction,
                                                                   a.rollout_correction_cap)  # fmt: skip
                    loss, info = algorithms.policy_loss(
                        a.policy_loss,
                        logp,
                        old_logp,
                        batch.advantages[rows].to(self.device),
                        m,
                        clip_low=a.clip_low,
                        clip_high=a.clip_high,
                        dual_clip=a.dual_clip,
                        loss_agg_mode=a.loss_agg_mode,
                        is_weights=is_weights,
                        **totals,
                    )
                    share = float(m.sum()) / totals["total_tokens"]
                    if batch.reference is not None:
                        kl = algorithms.kl_penalty(logp, batch.reference[rows].to(self.device), a.kl_estimator)
                        info["kl"] = float((kl.detach() * m).sum() / m.sum().clamp(min=1))
                        if not a.kl_in_reward:
                            loss = loss + a.kl_coef * algorithms.aggregate(kl, m, a.loss_agg_mode, **totals)
                    if a.entropy_coef:
                        loss = loss - a.entropy_coef * algorithms.aggregate(entropy, m, a.loss_agg_mode, **totals)
                    if micro is None:
                        (loss * 0.0).backward()
                        continue
                    (loss * self.dp.world if self.dp is not None else loss).backward()  # FSDP averages: sum instead
                    info.update({"loss": float(loss.detach()) / share if share else 0.0,
                                 "entropy": float((entropy.detach() * m).sum() / m.sum().clamp(min=1))})  # fmt: skip
                    for key, value in info.items():
                        sums[key] = sums.get(key, 0.0) + value * share
                grad_norm += float(self._optimizer_step())
        steps = a.ppo_epochs * a.mini_batches
        if self.dp is not None:  # each rank summed its share of every mini-batch
            sums, seen_old = self.dp.sum_metrics(sums), self.dp.sum(seen_old)
        metrics = {key: value / steps for key, value in sums.items()}
        metrics["grad_norm"] = grad_norm / steps
        metrics.update(algorithms.rollout_mismatch(seen_old, batch.rollout_logp, batch.response_mask))
        if a.rollout_correction != "none":
            weights = algorithms.rollout_is_weights(seen_old, batch.rollout_logp, batch.loss_mask,
                                                    a.rollout_correction, a.rollout_correction_cap)  # fmt: skip
            metrics["rollout/is_weight_mean"] = float(weights.sum() / batch.loss_mask.sum().clamp(min=1))
        return metrics

    def _optimizer_step(self) -> torch.Tensor:
        clip = self.config.actor.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable, clip if clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded: the norm over all ranks

    def _micro_batches(self, batch: "Batch", indices: list[int]) -> list[list[int] | None]:
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

    def _micro_batch(self, batch: "Batch", rows: list[int]):
        return micro_batch([batch.prompts[i] for i in rows], [batch.responses[i] for i in rows], batch.width,
                           self.device, self.layout, share_prompts=self.share_prompts)  # fmt: skip

    def _logprobs_all(self, batch: "Batch", reference: bool = False) -> torch.Tensor:
        """`[N, R]` log-probs of every response under the current policy (or the reference), no gradient."""
        temperature = self.config.rollout.temperature
        values = torch.zeros(len(batch.prompts), batch.width)
        context = self.policy.reference() if reference else _nothing(self.model)
        with context as model:
            model.eval()
            for micro in self._micro_batches(batch, list(range(len(batch.prompts)))):
                rows = micro or [0]  # None: a forward for the collectives only
                logp = response_logprobs(model, self._micro_batch(batch, rows), temperature=temperature)[0].cpu()
                if micro:
                    values[rows] = logp
        return self.dp.sum(values) if self.dp is not None else values

    def _check_versions(self, completions: list[Completion]) -> None:
        """Rollouts come from the trainer's current weights, or with `rollout.overlap` from at most one update
        before them."""
        lag = 1 if self.config.rollout.overlap else 0
        allowed = set(range(max(0, self.version - lag), self.version + 1))
        stale = {c.version for c in completions} - allowed
        if stale:
            raise EngineError(f"the engine generated with weights version {sorted(stale)}, expected "
                              f"{' or '.join(map(str, sorted(allowed)))}")  # fmt: skip

    def _choose_sync(self) -> dict:
        """`rollout.sync=auto`: time one rollout batch (the sync, then the generation) with the adapter served
        unmerged and with merged weights; keep the faster for the run. Returns the figures (`sync/auto_*`)."""
        r = self.config.rollout
        prompts = [e.prompt_ids for e in self.train_set[: self.config.data.batch_size]]
        figures = {}
        for mode in ("adapter", "merged"):
            started = time.perf_counter()
            self._sync(mode=mode)
            synced = time.perf_counter()
            if self.engine is not None:
                self.engine.generate(prompts, n=r.n, temperature=r.temperature, top_p=r.top_p,
                                     max_tokens=r.max_tokens, seed=0)  # fmt: skip
            figures[f"sync/auto_{mode}_sync_s"] = synced - started
            figures[f"sync/auto_{mode}_generate_s"] = time.perf_counter() - synced
        total = {mode: figures[f"sync/auto_{mode}_sync_s"] + figures[f"sync/auto_{mode}_generate_s"]
                 for mode in ("adapter", "merged")}  # fmt: skip
        choice = min(total, key=total.get)
        self.sync_mode = self.dp.broadcast(choice) if self.dp is not None else choice
        if self.sync_mode == "adapter":  # the engine holds merged weights now: give it the base back to serve on
            self._sync(mode="base")
        return {**figures, "sync/auto_chose_adapter": float(self.sync_mode == "adapter")}

    def _sync(self, version: int | None = None, mode: str | None = None):
        """Stream the merged weights (base + adapter, one layer at a time) into the engine (`mode` "merged"), only
        the adapter ("adapter": the engine serves it on the weights it holds, which must be the base), or the base
        weights alone ("base"); default: this run's sync mode. With data parallelism every rank takes part in the
        gathers; rank 0 sends."""
        version = self.version if version is None else version
        dtype, stats = self.rollout_dtype, None
        mode = mode or self.sync_mode
        if mode == "base":
            with self.model.disable_adapter():
                return self._sync(version, mode="merged")
        if mode == "adapter":
            from peft import get_peft_model_state_dict

            tensors = get_peft_model_state_dict(self.model)
            tensors = full_state_dict(tensors) if self.dp is not None else {k: v.detach() for k, v in tensors.items()}
            if self.engine is not None:
                config = self.model.peft_config["default"].to_dict()
                stats = self.engine.sync_adapter(tensors, config, version=version)
        elif self.engine is not None:
            stats = self.engine.sync_weights(iter_merged_weights(self.model, dtype=dtype), version=version,
                                             manifest=merged_weight_specs(self.model, dtype=dtype))  # fmt: skip
        else:  # a data-parallel rank other than 0: take part in each layer's gather
            for _ in iter_merged_weights(self.model, dtype=dtype):
                pass
        self.version = version
        return stats

    def evaluate(self) -> dict:
        """Greedy answers to the validation prompts: mean reward, and accuracy (share with full reward, >= 1)."""
        completions = self.engine.generate([e.prompt_ids for e in self.val_set], n=1, temperature=0.0, top_p=1.0,
                                           max_tokens=self.config.rollout.max_tokens, seed=0)  # fmt: skip
        self._check_versions(completions)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        scores = rewards.score(
            self.reward_fn, [e.prompt for e in self.val_set], texts, [e.answer for e in self.val_set]
        )
        return {"val/reward": float(np.mean(scores)), "val/accuracy": float(np.mean([s >= 1.0 for s in scores]))}

    def save(self, step: int) -> Path | None:
        """A checkpoint by the main rank; with data parallelism every rank first takes part in gathering the
        trainable weights and the optimizer state (saved whole: it resumes on any number of ranks)."""
        optimizer = checkpoint.optimizer_state(self.model, self.optimizer)
        weights = None
        if self.dp is not None:
            trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
            weights = full_state_dict({k: v for k, v in self.model.state_dict().items() if k in trainable or
                                       not self.policy.is_lora})  # fmt: skip
        if not self.is_main:
            return None
        state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                 "prefetched": self._prefetched}  # fmt: skip
        return checkpoint.save(self.output_dir, step, self.model, is_lora=self.policy.is_lora, state=state,
                               config_yaml=to_yaml(self.config), weights=weights)  # fmt: skip

    def _say(self, text: str, progress=None) -> None:
        """A line above the live progress bar (or on the console)."""
        if progress is not None:
            progress.console.print(text, markup=False)
        elif self.console is not None:
            self.console.print(text, markup=False)

    def _progress_bar(self):
        """A live bar: steps done, reward, KL, validation accuracy, seconds per step, time left."""
        if self.console is None:
            return _nothing(None)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=self.console,
        )  # fmt: skip
        progress.add_task("train", total=self.config.trainer.steps, completed=self.start_step, status="")
        return progress


@dataclass
class Sample:
    """One response, scored: `score` is the reward function's value, `reward` what advantages see (after shaping)."""

    prompt_ids: list[int]
    completion: Completion
    group: int  # responses to the same prompt (in this step) share it
    score: float
    reward: float


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
    reference: torch.Tensor | None = None
    old: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


def _batch(samples: list[Sample], *, mask_truncated: bool) -> Batch:
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
    )


def _rollout_metrics(samples: list[Sample]) -> dict:
    """What the policy does, over every response generated this step (kept by dynamic sampling or not)."""
    scores = np.array([s.score for s in samples])
    lengths = np.array([len(s.completion.token_ids) for s in samples])
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std(ddof=1)) if scores.size > 1 else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/truncated": float(np.mean([not s.completion.finished for s in samples])),
    }
    penalties = np.array([s.reward - s.score for s in samples])
    if penalties.any():
        metrics["reward/overlong_penalty"] = float(penalties.mean())
    return metrics


def _sync_choice(figures: dict) -> str:
    parts = [f"{mode}: sync {figures[f'sync/auto_{mode}_sync_s']:.2f} s + rollout "
             f"{figures[f'sync/auto_{mode}_generate_s']:.2f} s" for mode in ("adapter", "merged")]  # fmt: skip
    choice = "adapter" if figures["sync/auto_chose_adapter"] else "merged"
    return f"rollout.sync=auto chose {choice} ({'; '.join(parts)})"


def _status(metrics: dict) -> str:
    parts = [f"reward {metrics['reward/mean']:.3f}"]
    if "kl" in metrics:
        parts.append(f"kl {metrics['kl']:.4f}")
    parts.append(f"{metrics['timing/step_s']:.2f} s/step")
    return "  ".join(parts)


def _line(step: int, total: int, metrics: dict) -> str:
    return f"step {step}/{total}  {_status(metrics)}  val acc {metrics['val/accuracy']:.3f}"


class _nothing:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - libraries draw from numpy's global generator
    torch.manual_seed(seed)


def _step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The seed of a step's sampling (and its `round_`-th extra sampling round with dynamic sampling)."""
    return seed * 1_000_003 + step + round_ * 1_000_000_007


def _lr_factor(warmup: int, total: int, schedule: str):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _summary(metrics_file: Path, first_eval: dict) -> dict:
    from lorarl.trainer.metrics import read

    records = read(metrics_file) if metrics_file.is_file() else []
    accuracies = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    return {
        "steps": max((r["step"] for r in records), default=0),
        "val_accuracy_start": accuracies[0] if accuracies else first_eval.get("val/accuracy"),
        "val_accuracy_end": accuracies[-1] if accuracies else None,
        "reward_last": next((r["reward/mean"] for r in reversed(records) if "reward/mean" in r), None),
    }
