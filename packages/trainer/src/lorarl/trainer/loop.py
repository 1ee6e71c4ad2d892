"""The training loop: rollouts -> rewards -> advantages -> policy update -> merged weights into the engine.

Each stage lives in a module of its own — `rollout` (prompts, engine, rewards, dynamic sampling), `update`
(advantages, PPO epochs x mini-batches x micro-batches), `weights` (the sync modes), `evaluation`, `checkpoint` —
and `Trainer.train_step` reads them in order.
"""

import contextlib
import random
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from lorarl.trainer import algorithms, checkpoint, data, scoring, threads
from lorarl.trainer.config import Config, to_yaml
from lorarl.trainer.console import Console, summary
from lorarl.trainer.context import fit_context
from lorarl.trainer.engines import EngineContext, RolloutEngine, start_engine
from lorarl.trainer.envs.episodes import episode_runner
from lorarl.trainer.errors import ConfigError, TrainerError
from lorarl.trainer.evaluation import evaluate
from lorarl.trainer.interrupt import StopRequest
from lorarl.trainer.logprobs import resolve_layout, scores_from_hidden
from lorarl.trainer.metrics import MetricsLog, SamplesLog, cuda_memory, plot, sample_rows
from lorarl.trainer.models import (
    Critic,
    Mixture,
    Policy,
    adapts_fused_experts,
    load_tokenizer,
    resolve_device,
    resolve_model_path,
    rollout_dtype,
    warn_slow_dtypes,
)
from lorarl.trainer.parallel import full_state_dict, gathered_trainable, setup_data_parallel, shard
from lorarl.trainer.recompute import checkpoint_layers
from lorarl.trainer.rollout import Rollouts, sampling_params
from lorarl.trainer.routing import Routers, attach, unreplayable
from lorarl.trainer.staleness import StaleBatches
from lorarl.trainer.sync_kinds import AUTO, SYNC_KINDS
from lorarl.trainer.update import ActorUpdate, to_batch
from lorarl.trainer.weights import WeightSync, describe_choice


def warning_hints(config: Config) -> dict[str, str]:
    """What to check when a warning comes (`console.WARNINGS`): the run's settings, by warning."""
    r, env = config.rollout, config.env
    return {"response_length/truncated": f"rollout.max_tokens={r.max_tokens}"
            + ("" if env.name == "none" else f", env.max_tokens={env.max_tokens}") + ": raise it",
            "env/stop/parse_error": f"env.tool_format={env.tool_format}: a tool the model was not trained to call, or "
            "another format?",
            "env/failed": f"env.on_error={env.on_error}, env.timeout_s={env.timeout_s:g}",
            "env/hung_threads": f"the run stops once env.max_hung_calls={env.max_hung_calls} are left"}  # fmt: skip


class Trainer:
    def __init__(self, config: Config, *, console=None):
        self.config = config
        t = config.trainer
        self.console = Console(console, t.steps)
        output = Path(t.output_dir or f"outputs/{datetime.now():%Y%m%d-%H%M%S}")
        fresh = not output.exists()
        self.output_dir = checkpoint.output_dir(str(output))
        try:
            self._start(config)
        except BaseException:
            if fresh:  # a run that failed to start leaves no empty output folder behind
                with contextlib.suppress(OSError):
                    self.output_dir.rmdir()
            raise

    def _start(self, config: Config) -> None:
        """Everything a run starts from: the data, reward and environment first (a missing file or an unusable tool
        is reported in seconds, not after the model has loaded), then the model and the update."""
        t, r = config.trainer, config.rollout
        _seed_everything(t.seed)
        self.threads = threads.configure(t.threads)  # from here: loading the model counts as its first busy time
        model_dir = resolve_model_path(config.model.path, config.model.gguf_file, config.model.dtype,
                                       config.model.revision)  # fmt: skip
        self.tokenizer = load_tokenizer(model_dir)
        self.episodes = episode_runner(config, self.tokenizer)  # multi-turn: the environment's runner
        fit_context(config, model_dir, self.episodes)  # data.max_prompt_tokens (env.max_tokens) set, or checked
        self.console.hints = warning_hints(config)
        owns = self.episodes is not None and self.episodes.owns_data
        self.train_set, dropped = data.load_examples("train", self.tokenizer, config.data, env_owns_data=owns)
        self.val_set, val_dropped = data.load_examples("val", self.tokenizer, config.data, env_owns_data=owns)
        if config.data.val_size:
            self.val_set = self.val_set[: config.data.val_size]
        self.dropped = {"train": dropped, "val": val_dropped}
        if self.episodes is not None:  # rows its environment cannot play: named now, not when drawn
            self.episodes.environment.check_examples(self.train_set + self.val_set)
        self.reward = scoring.Rewards(config.reward, t.steps)
        self.reward.check_answers(self.train_set + self.val_set)
        self.dp, self.device = setup_data_parallel(resolve_device(t.device))
        self.policy = Policy(config.model, self.device, kl_coef=config.algorithm.kl_coef)
        uses_critic = algorithms.ADVANTAGES[config.algorithm.adv_estimator].needs_values
        self.critic = Critic(config.critic, self.policy, self.device) if uses_critic else None
        fused_experts = r.engine == "hf" and bool(Mixture.of(self.policy.model).experts)
        self.rollout_dtype = rollout_dtype(r.dtype, self.policy.dtype, self.device, fused_experts=fused_experts)
        if self.is_main:
            warn_slow_dtypes({"model.dtype": config.model.dtype, "rollout.dtype": r.dtype,
                              "actor.autocast": config.actor.autocast}, self.device)  # fmt: skip
        self.model = self.policy.model
        self.routers = recorded_routers(config, self.policy, self.critic)  # before sharding wraps them
        layout = resolve_layout(config.actor.layout, self.model)  # before sharding renames the classes
        if config.actor.gradient_checkpointing:
            checkpoint_layers(self.model)
            if self.critic is not None and not self.critic.shares_base:
                checkpoint_layers(self.critic.model)
        # a GRPO group's responses share their prompt: run it once (padded layout, log-probs from the hidden states)
        share_prompts = layout == "padded" and r.n > 1 and scores_from_hidden(self.model)
        resume_from = checkpoint.to_resume(t.resume, self.output_dir)
        if resume_from is None and t.resume == "auto":
            self.console.say(f"no checkpoint in {self.output_dir}: starting a fresh run")
        if resume_from is not None:  # before sharding: every rank reads the full weights
            checkpoint.check_resumable(resume_from, config, critic=self.critic is not None)
            checkpoint.load_policy(resume_from, self.model, is_lora=self.policy.is_lora)
            if self.critic is not None:
                checkpoint.load_critic(resume_from, self.critic)
        if self.dp is not None:
            shard(self.model, self.dp.mesh)
            if self.critic is not None:
                shard(self.critic.head, self.dp.mesh)
                if not self.critic.shares_base:
                    shard(self.critic.model, self.dp.mesh)
        self.sampler = data.PromptSampler(len(self.train_set), config.data.batch_size, t.seed)
        self.actor = ActorUpdate(config, self.policy, self.device, self.dp, layout=layout, share_prompts=share_prompts,
                                 critic=self.critic, routers=self.routers)  # fmt: skip
        self.prefetched = None  # a resumed run's next batch, generated before the checkpoint (rollout.overlap)
        self.resumed_in_flight = None  # a resumed run's batches in flight (rollout.max_staleness)
        if r.max_staleness and self.dp is not None:
            raise ConfigError(f"rollout.max_staleness={r.max_staleness} with data-parallel ranks: not yet (one rank)")
        self.start_step = self._resume(resume_from)
        # the engine and what it feeds: on the main rank from `start_engine`; on the others a sync without an engine
        self.engine: RolloutEngine | None = None  # the one holding the newest weights (evaluations use it)
        self.engines: list[RolloutEngine] = []  # more than one with rollout.max_staleness
        self.stale: StaleBatches | None = None
        self.rollouts: Rollouts | None = None
        self.sync_forms: tuple[str, ...] | None = None  # the update forms the engine takes (`start_engine`)
        self.weights = None if self.is_main else self._weight_sync(None)
        self.samples_log: SamplesLog | None = None  # the main rank's, while it runs with trainer.log_samples

    # --- the step ------------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        """Rollouts (scored), advantages, the update, then the new weights into the engine."""
        a = self.config.algorithm
        started = time.perf_counter()
        if self.stale is not None:  # rollout.max_staleness: this step's batch and the next k ones in flight
            self.stale.start(step, self.weights.version, self.config.trainer.steps)
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
        with threads.busy():
            batch = to_batch(samples, mask_truncated=a.mask_truncated, routers=self.routers)
            self.actor.advantages(batch)
            metrics.update(self.actor.update(step, batch))
        train_s = time.perf_counter() - train_started
        if self.samples_log is not None:
            self.samples_log.log(step, sample_rows(samples[: self.config.trainer.log_samples], batch, self.tokenizer))

        if keep_next is not None:  # before the sync: the engine answers in order
            waited = time.perf_counter()
            keep_next()
            rollout_s += time.perf_counter() - waited
        sync_started = time.perf_counter()
        with threads.busy():
            if self.stale is not None:  # the engine whose batch this step trained on takes the new weights
                stats = self.stale.sync(step)
                self.engine, self.weights = self.stale.newest_engine()
            else:
                stats = self.weights.sync(version=step)
        return {
            **metrics,
            "lr": self.actor.optimizer.lr,
            "data/epoch": self.sampler.epoch,
            "timing/rollout_s": rollout_s,
            "timing/train_s": train_s,
            "timing/sync_s": time.perf_counter() - sync_started,
            "timing/step_s": time.perf_counter() - started,
            "sync/bytes": stats.bytes if stats is not None else 0,
            "threads": threads.current(),
            **cuda_memory(self.device),
        }

    # --- the run -------------------------------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """The rank that owns the engine, the logs and the checkpoints (the only one without data parallelism)."""
        return self.dp is None or self.dp.is_main

    def run(self, stop: StopRequest | None = None) -> dict:
        """The run, to `trainer.steps` or until `stop` is requested (a signal; entered by the caller, or here)."""
        if stop is None:
            with StopRequest(self.console.say) as stop:
                return self.run(stop)
        t = self.config.trainer
        if not self.is_main:
            return self._follow(stop)
        (self.output_dir / "config.yaml").write_text(to_yaml(self.config))
        console = self.console
        console.say(f"outputs: {self.output_dir.resolve()}")
        console.say(self.threads.describe())
        if any(self.dropped.values()):
            console.say(f"dropped prompts longer than {self.config.data.max_prompt_tokens} tokens: {self.dropped}")
        if self.start_step >= t.steps:
            console.say(f"nothing to train: the checkpoint is at step {self.start_step} and trainer.steps={t.steps} "
                        "(raise trainer.steps to continue)")  # fmt: skip
        log = MetricsLog(self.output_dir, resume_step=self.start_step, loggers=t.loggers, project=t.wandb_project,
                         config=OmegaConf.to_container(OmegaConf.structured(self.config)))  # fmt: skip
        if t.log_samples:
            self.samples_log = SamplesLog(self.output_dir, resume_step=self.start_step)
        self.start_engine()
        stopped_at = None
        try:
            with console.live(self.start_step):
                stop.say = console.say
                chosen = self._choose_sync() if self.config.rollout.sync == AUTO else {}
                if chosen:
                    console.say(describe_choice(chosen))
                for sync in self.syncs:  # an engine starts from disk: give it this run's weights (an adapter, a resume)
                    sync.sync()
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
            for engine in self.engines:
                engine.close()
            if self.episodes is not None:
                self.episodes.close()
            self.reward.close()
            log.close()
            if self.samples_log is not None:
                self.samples_log.close()
        plots = plot(log.path, self.output_dir / "plots")
        result = summary(log.path, first_eval)
        result.update({"output_dir": str(self.output_dir), "plots": [str(p) for p in plots], "stopped_at": stopped_at,
                       "stopped_by": stop.signal_name if stopped_at else None})  # fmt: skip
        return result

    def _follow(self, stop: StopRequest) -> dict:
        """A data-parallel rank other than 0: the same steps, its share of the training, the collectives (it stops
        where rank 0 does)."""
        t = self.config.trainer
        if self.config.rollout.sync == AUTO:
            self._choose_sync()
        self.weights.sync()
        for step in range(self.start_step + 1, t.steps + 1):
            self.train_step(step)
            if self._checkpoint_or_stop(step, stop):
                break
        return {}

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
        kinds = SYNC_KINDS.entries() if r.sync == AUTO else [SYNC_KINDS[r.sync]]  # auto may end on any
        if r.engine == "vllm" and adapts_fused_experts(self.model):  # vLLM's LoRA takes per-expert layers only
            if r.sync != AUTO and SYNC_KINDS[r.sync].form == "adapter":
                raise TrainerError(f"rollout.sync={r.sync}: vLLM cannot serve a LoRA on fused experts (peft's "
                                   "target_parameters); use rollout.sync=merged or factors, or leave the experts out "
                                   "(model.lora.exclude_modules=[experts])")  # fmt: skip
            kinds = [kind for kind in kinds if kind.form != "adapter"]
        self.sync_forms = tuple(sorted({kind.form for kind in kinds}))
        lora_rank = self.model.peft_config["default"].r if hasattr(self.model, "peft_config") else 0
        context = EngineContext(str(self.policy.path), self.rollout_dtype, str(self.device),
                                self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, t.seed,
                                self.sync_forms, lora_rank, r.overlap,
                                self.config.data.batch_size * r.n,
                                self.config.data.max_prompt_tokens + self.actor.norm_len, t.threads,
                                record_routes=self.routers is not None)  # fmt: skip
        self.engines = [start_engine(r, context, backend=t.backend, ray_address=t.ray_address)
                        for _ in range(r.max_staleness + 1)]  # fmt: skip
        self.syncs = [self._weight_sync(engine) for engine in self.engines]
        newest = self.start_step % len(self.engines)  # (with rollout.max_staleness: not one of a resumed batch's)
        self.engine, self.weights = self.engines[newest], self.syncs[newest]
        self.rollouts = Rollouts(self.config, self.engine, self.train_set, self.sampler, self.tokenizer, self.reward,
                                 prefetched=self.prefetched, episodes=self.episodes)  # fmt: skip
        if r.max_staleness:
            self.stale = StaleBatches(r.max_staleness, self.model, self.engines, self.syncs, self.rollouts,
                                      self.resumed_in_flight, in_flight_updates=r.in_flight_updates,
                                      newest=newest)  # fmt: skip
        return self.engine

    def _weight_sync(self, engine: RolloutEngine | None) -> WeightSync:
        sync = self.config.rollout.sync
        return WeightSync(self.model, engine, kind="merged" if sync == AUTO else sync, dtype=self.rollout_dtype,
                          dp=self.dp, version=self.start_step, forms=self.sync_forms)  # fmt: skip

    def _choose_sync(self) -> dict:
        prompts = [e.prompt_ids for e in self.train_set[: self.config.data.batch_size]]
        sampling = sampling_params(self.config.rollout, seed=0)
        return self.weights.choose(lambda: self.engine.generate(prompts, sampling))

    def evaluate(self) -> dict:
        """Greedy answers to the validation prompts: mean reward and accuracy (on the engine holding the newest
        weights; with rollout.in_flight_updates, while the batches in flight wait for it)."""
        with self.stale.locks[self.stale.newest] if self.stale is not None else contextlib.nullcontext():
            return evaluate(self.engine, self.val_set, self.tokenizer, self.reward,
                            max_tokens=self.config.rollout.max_tokens, version=self.weights.version,
                            episodes=self.episodes)  # fmt: skip

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
            weights = gathered_trainable(self.model, self.policy.is_lora)
            if critic is not None:
                critic_weights = weights if critic.shares_base else gathered_trainable(critic.model, critic.is_lora)
        if critic is not None:
            state["critic"] = self.actor.critic_optimizer.state_dict(critic.modules)
            head = full_state_dict(critic.head.state_dict())
        if not self.is_main:
            return None
        state.update({"sampler": self.sampler.state_dict(), "prefetched": self.rollouts.prefetched})
        if self.stale is not None:  # the batches in flight start again on resuming, drawn again from here
            in_flight = self.rollouts.in_flight
            state.update({"in_flight": self.stale.state(),
                          "sampler": in_flight[min(in_flight)].sampler_state if in_flight else state["sampler"]})

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
        self.sampler.load_state_dict(state["sampler"])
        self.prefetched = state.get("prefetched")
        self.resumed_in_flight = state.get("in_flight")
        self.console.say(f"resumed from {path} (step {state['step']})")
        return state["step"]


def recorded_routers(config: Config, policy: Policy, critic: Critic | None) -> Routers | None:
    """The policy's routers whose routes the engine records (`rollout.record_routes`), hooked for the trainer's side
    (and those of the copies a full fine-tune keeps: its frozen reference, a critic's own base): to compare their
    choices with the engine's, and replay those (`algorithm.routing_replay`); None where none are."""
    r, replay, model = config.rollout, config.algorithm.routing_replay, policy.model
    why = unreplayable(model)
    if replay and r.record_routes == "never":
        why = "it replays the routes the engine records, and rollout.record_routes=never records none"
    if why and (replay or r.record_routes == "always"):
        raise ConfigError(f"{'algorithm.routing_replay=true' if replay else 'rollout.record_routes=always'}: {why}")
    if why or not (replay or r.record_routes == "always" or (r.engine == "hf" and r.record_routes == "auto")):
        return None
    routers = Routers.of(model)
    attach(routers)
    copies = [policy.frozen_reference, None if critic is None or critic.shares_base else critic.model]
    for copy in filter(None, copies):
        attach(Routers.of(copy))
    return routers


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - libraries draw from numpy's global generator
    torch.manual_seed(seed)
