"""The training loop: rollouts -> rewards -> advantages -> policy update -> merged weights into the engine.

Each stage lives in a module of its own — `rollout` (prompts, engine, rewards, dynamic sampling), `update`
(advantages, PPO epochs x mini-batches x micro-batches), `weights` (the sync modes), `evaluation`, `checkpoint` —
and `Trainer.train_step` reads them in order.
"""

import random
import time
import warnings
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from lorarl.trainer import algorithms, checkpoint, data, rewards
from lorarl.trainer.config import Config, to_yaml
from lorarl.trainer.console import Console, summary
from lorarl.trainer.engines import EngineContext, RolloutEngine, placement, start_engine
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.evaluation import evaluate
from lorarl.trainer.interrupt import StopRequest
from lorarl.trainer.logprobs import resolve_layout, scores_from_hidden
from lorarl.trainer.metrics import MetricsLog, SamplesLog, plot
from lorarl.trainer.models import (
    DTYPES,
    Critic,
    Policy,
    computes_natively,
    load_tokenizer,
    resolve_device,
    rollout_dtype,
)
from lorarl.trainer.parallel import full_state_dict, setup_data_parallel, shard
from lorarl.trainer.recompute import checkpoint_layers
from lorarl.trainer.rollout import Rollouts
from lorarl.trainer.update import ActorUpdate, to_batch
from lorarl.trainer.weights import WeightSync, describe_choice


def cuda_memory(device: torch.device) -> dict[str, float]:
    """The peak GPU memory torch allocated in this process so far (an engine in a process of its own not counted)."""
    if device.type != "cuda":
        return {}
    return {"memory/cuda_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9}


class Trainer:
    def __init__(self, config: Config, *, console=None):
        self.config = config
        t, r = config.trainer, config.rollout
        self.console = Console(console, t.steps)
        self.output_dir = Path(t.output_dir or f"outputs/{datetime.now():%Y%m%d-%H%M%S}")
        _check_settings(config)
        _seed_everything(t.seed)
        self.dp, self.device = setup_data_parallel(resolve_device(t.device))
        self.policy = Policy(config.model, self.device, kl_coef=config.algorithm.kl_coef)
        uses_critic = getattr(algorithms.ADVANTAGES[config.algorithm.adv_estimator], "needs_values", False)
        self.critic = Critic(config.critic, self.policy, self.device) if uses_critic else None
        self.rollout_dtype = rollout_dtype(r.dtype, self.policy.dtype, self.device)
        if self.is_main:
            _warn_slow_dtypes(config, self.device)
        self.model = self.policy.model
        layout = resolve_layout(config.actor.layout, self.model)  # before sharding renames the classes
        if config.actor.gradient_checkpointing:
            checkpoint_layers(self.model)
            if self.critic is not None and not self.critic.shares_base:
                checkpoint_layers(self.critic.model)
        # a GRPO group's responses share their prompt: run it once (padded layout, log-probs from the hidden states)
        share_prompts = layout == "padded" and r.n > 1 and scores_from_hidden(self.model)
        resume_from = checkpoint.to_resume(t.resume, self.output_dir)
        if resume_from is not None:  # before sharding: every rank reads the full weights
            checkpoint.load_policy(resume_from, self.model, is_lora=self.policy.is_lora)
            if self.critic is not None:
                checkpoint.load_critic(resume_from, self.critic)
        if self.dp is not None:
            shard(self.model, self.dp.mesh)
            if self.critic is not None:
                shard(self.critic.head, self.dp.mesh)
                if not self.critic.shares_base:
                    shard(self.critic.model, self.dp.mesh)
        self.tokenizer = load_tokenizer(self.policy.path)
        train_set, dropped = data.load_examples(config.data.train_files, "train.jsonl", self.tokenizer, config.data)
        self.val_set, val_dropped = data.load_examples(config.data.val_files, "val.jsonl", self.tokenizer, config.data)
        if config.data.val_size:
            self.val_set = self.val_set[: config.data.val_size]
        self.dropped = {"train": dropped, "val": val_dropped}
        self.reward = rewards.Rewards(config.reward)
        sampler = data.PromptSampler(len(train_set), config.data.batch_size, t.seed)
        self.rollouts = Rollouts(config, train_set, sampler, self.tokenizer, self.reward)
        self.actor = ActorUpdate(config, self.policy, self.device, self.dp, layout=layout, share_prompts=share_prompts,
                                 critic=self.critic)  # fmt: skip
        self.start_step = self._resume(resume_from)
        self.weights = WeightSync(self.model, mode=r.sync, dtype=self.rollout_dtype, dp=self.dp,
                                  version=self.start_step)  # fmt: skip
        self.engine: RolloutEngine | None = None
        self.samples_log: SamplesLog | None = None  # the main rank's, while it runs with trainer.log_samples

    # --- the step ------------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        """Rollouts (scored), advantages, the update, then the new weights into the engine."""
        a = self.config.algorithm
        started = time.perf_counter()
        samples, metrics = self.rollouts.collect(step, self.weights.version) if self.is_main else (None, None)
        if self.dp is not None:
            samples, metrics = self.dp.broadcast((samples, metrics))
        rollout_s = time.perf_counter() - started
        # rollout.overlap: the next batch generates on these weights while the trainer trains (at the last step
        # too: a checkpoint keeps it for resuming)
        keep_next = self.rollouts.prefetch(step + 1) if self.config.rollout.overlap and self.is_main else None
        if self.engine is not None and self.engine.capabilities.sleep:  # a colocated engine frees the GPU to train
            self.engine.sleep()

        train_started = time.perf_counter()
        batch = to_batch(samples, mask_truncated=a.mask_truncated)
        self.actor.advantages(batch)
        metrics.update(self.actor.update(step, batch))
        train_s = time.perf_counter() - train_started
        if self.samples_log is not None:
            self.samples_log.log(step, self._sample_rows(samples, batch))

        if keep_next is not None:  # before the sync: the engine answers in order
            waited = time.perf_counter()
            keep_next()
            rollout_s += time.perf_counter() - waited
        sync_started = time.perf_counter()
        stats = self.weights.sync(version=step)
        return {
            **metrics,
            "lr": self.actor.optimizer.lr,
            "data/epoch": self.rollouts.sampler.epoch,
            "timing/rollout_s": rollout_s,
            "timing/train_s": train_s,
            "timing/sync_s": time.perf_counter() - sync_started,
            "timing/step_s": time.perf_counter() - started,
            "sync/bytes": stats.bytes if stats is not None else 0,
            **cuda_memory(self.device),
        }

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
        console = self.console
        console.say(f"outputs: {self.output_dir.resolve()}")
        if any(self.dropped.values()):
            console.say(f"dropped prompts longer than {self.config.data.max_prompt_tokens} tokens: {self.dropped}")
        log = MetricsLog(self.output_dir, resume_step=self.start_step, loggers=t.loggers, project=t.wandb_project,
                         config=OmegaConf.to_container(OmegaConf.structured(self.config)))  # fmt: skip
        if t.log_samples:
            self.samples_log = SamplesLog(self.output_dir, resume_step=self.start_step)
        self.start_engine()
        stopped_at = None
        try:
            with console.live(self.start_step), StopRequest(console.say) as stop:
                chosen = self._choose_sync() if self.config.rollout.sync == "auto" else {}
                if chosen:
                    console.say(describe_choice(chosen))
                self.weights.sync()  # the engine starts from disk: give it this run's weights (an adapter, a resume)
                first_eval = self.evaluate() if t.eval_every else {}
                if (first_eval or chosen) and self.start_step == 0:
                    log.log(0, {**chosen, **first_eval})
                if first_eval and self.start_step == 0:
                    console.say(f"step 0: validation accuracy {first_eval['val/accuracy']:.3f}")
                for step in range(self.start_step + 1, t.steps + 1):
                    metrics = self.train_step(step)
                    if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                        metrics.update(self.evaluate())
                    log.log(step, metrics)
                    console.step_done(step, metrics)
                    if self._checkpoint_or_stop(step, stop):
                        stopped_at = step
                        break
        finally:
            self.engine.close()
            self.reward.close()
            log.close()
            if self.samples_log is not None:
                self.samples_log.close()
        plots = plot(log.path, self.output_dir / "plots")
        result = summary(log.path, first_eval)
        result.update({"output_dir": str(self.output_dir), "plots": [str(p) for p in plots], "stopped_at": stopped_at})
        return result

    def _follow(self) -> dict:
        """A data-parallel rank other than 0: the same steps, its share of the training, the collectives."""
        t = self.config.trainer
        if self.config.rollout.sync == "auto":
            self._choose_sync()
        self.weights.sync()
        with StopRequest(lambda text: None) as stop:
            for step in range(self.start_step + 1, t.steps + 1):
                self.train_step(step)
                if self._checkpoint_or_stop(step, stop):
                    break
        return {}

    def _sample_rows(self, samples: list, batch) -> list[dict]:
        """The first `trainer.log_samples` responses of the step as text, with their score, reward (after shaping)
        and advantage (the mean over their tokens; with GAE it varies along the response)."""
        rows = []
        for i, sample in enumerate(samples[: self.config.trainer.log_samples]):
            advantages = batch.advantages[i][batch.response_mask[i]]
            rows.append({
                "prompt": self.tokenizer.decode(sample.prompt_ids),
                "completion": self.tokenizer.decode(list(sample.completion.token_ids), skip_special_tokens=True),
                "score": sample.score, "reward": sample.reward,
                "advantage": float(advantages.mean()) if advantages.numel() else 0.0,
                "tokens": len(sample.completion.token_ids), "finished": sample.completion.finished,
            })  # fmt: skip
        return rows

    def _checkpoint_or_stop(self, step: int, stop: StopRequest) -> bool:
        """After each step, on every rank: whether the run stops here (Ctrl-C before the last step; rank 0's word, so
        that every rank stops at the same step), with a checkpoint then and at the `trainer.save_every` steps."""
        requested = self.dp.broadcast(stop.requested) if self.dp is not None else stop.requested
        stopping = requested and step < self.config.trainer.steps
        if stopping or self._saves_at(step):
            self.save(step)
        return stopping

    def start_engine(self) -> RolloutEngine:
        """The rollout engine `rollout.*` describes (`engines.start_engine`), started and fed by this trainer."""
        r, t = self.config.rollout, self.config.trainer
        if r.sync != "merged" and not self.policy.is_lora:
            raise TrainerError(f"rollout.sync={r.sync} needs a LoRA adapter (model.lora.rank > 0)")
        adapter_rank = self.model.peft_config["default"].r if r.sync in ("adapter", "auto") else None
        context = EngineContext(str(self.policy.path), self.rollout_dtype, str(self.device),
                                self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, t.seed, adapter_rank,
                                r.overlap, self.config.data.batch_size * r.n,
                                self.config.data.max_prompt_tokens + r.max_tokens)  # fmt: skip
        engine = start_engine(r, context, backend=t.backend, ray_address=t.ray_address)
        self.engine = self.rollouts.engine = self.weights.engine = engine
        return engine

    def _choose_sync(self) -> dict:
        r = self.config.rollout
        prompts = [e.prompt_ids for e in self.rollouts.examples[: self.config.data.batch_size]]

        def generate() -> None:
            self.engine.generate(prompts, n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                 seed=0)  # fmt: skip

        return self.weights.choose(generate)

    def evaluate(self) -> dict:
        """Greedy answers to the validation prompts: mean reward and accuracy."""
        return evaluate(self.engine, self.val_set, self.tokenizer, self.reward,
                        max_tokens=self.config.rollout.max_tokens, version=self.weights.version)  # fmt: skip

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def _saves_at(self, step: int) -> bool:
        """A checkpoint every `trainer.save_every` steps, and at the end."""
        t = self.config.trainer
        return bool(t.save_every and step % t.save_every == 0) or step == t.steps

    def save(self, step: int) -> Path | None:
        """A checkpoint by the main rank; with data parallelism every rank first takes part in gathering the
        trainable weights and the optimizers' states (saved whole: it resumes on any number of ranks)."""
        critic = self.critic
        state = {"actor": self.actor.optimizer.state_dict(self.model)}
        weights = critic_weights = None
        if self.dp is not None:
            weights = _gathered(self.model, self.policy.is_lora)
            if critic is not None:
                critic_weights = weights if critic.shares_base else _gathered(critic.model, critic.is_lora)
        if critic is not None:
            state["critic"] = self.actor.critic_optimizer.state_dict(critic.modules)
            head = full_state_dict(critic.head.state_dict())
        if not self.is_main:
            return None
        state.update({"sampler": self.rollouts.sampler.state_dict(), "prefetched": self.rollouts.prefetched})

        def write_weights(directory: Path) -> None:
            checkpoint.save_policy(directory, self.model, is_lora=self.policy.is_lora, weights=weights)
            if critic is not None:
                checkpoint.save_critic(directory, critic, weights=critic_weights, head=head)

        return checkpoint.save(self.output_dir, step, write_weights, state=state, config_yaml=to_yaml(self.config))

    def _resume(self, path: Path | None) -> int:
        """The optimizers, schedules, data position and RNG of the checkpoint whose weights are loaded already."""
        if path is None:
            return 0
        state = checkpoint.load_state(path)
        actor = state.get("actor") or {"optimizer": state["optimizer"], "scheduler": state["scheduler"]}  # (older runs)
        self.actor.optimizer.load_state_dict(self.model, actor)
        if self.critic is not None:
            self.actor.critic_optimizer.load_state_dict(self.critic.modules, state["critic"])
        self.rollouts.sampler.load_state_dict(state["sampler"])
        self.rollouts.prefetched = state.get("prefetched")
        self.console.say(f"resumed from {path} (step {state['step']})")
        return state["step"]


def _warn_slow_dtypes(config: Config, device: torch.device) -> None:
    """16-bit weights the device does not compute natively: allowed (they halve the memory), but said, since the run
    is then many times slower than in float32."""
    # rollout.dtype=auto picks a 16-bit dtype this slow only as model.dtype, already named
    chosen = {"model.dtype": config.model.dtype, "rollout.dtype": config.rollout.dtype}
    slow = [
        f"{key}={name}"
        for key, name in chosen.items()
        if name in DTYPES and not computes_natively(DTYPES[name], device)
    ]
    if slow:
        warnings.warn(f"{' and '.join(slow)}: this CPU has no instructions for 16-bit matmuls (AVX512-BF16 or AMX for "
                      "bfloat16, AVX512-FP16 or AMX-FP16 for float16), so torch runs them many times slower than "
                      "float32 (a 46M model's step took 23x as long in bfloat16 on an AVX2 CPU); float32 is faster "
                      "here", stacklevel=3)  # fmt: skip


def _check_settings(config: Config) -> None:
    """Combinations of settings the trainer cannot run, refused before anything loads."""
    r, t, a = config.rollout, config.trainer, config.algorithm
    if r.replicas > 1 and t.backend != "ray":
        raise TrainerError(f"rollout.replicas={r.replicas} needs trainer.backend=ray")
    if r.overlap and a.rollout_correction == "none":
        raise TrainerError("rollout.overlap trains on rollouts of the weights one update behind: set "
                           "algorithm.rollout_correction=token (or sequence) to correct for that")  # fmt: skip
    band = list(a.rollout_correction_band)
    if len(band) != 2 or not 0 <= band[0] <= 1 <= band[1]:
        raise TrainerError(f"algorithm.rollout_correction_band={band}: expected [low, high] with 0 <= low <= 1 <= high")
    if r.overlap and placement(r, t.backend) == "inline":
        raise TrainerError("rollout.overlap generates beside the training: it needs rollout.worker=process")


def _gathered(model: torch.nn.Module, is_lora: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of a sharded model (its trainable weights, or all of a full fine-tune), gathered."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return full_state_dict({k: v for k, v in model.state_dict().items() if k in trainable or not is_lora})


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - libraries draw from numpy's global generator
    torch.manual_seed(seed)
