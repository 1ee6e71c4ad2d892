"""The configuration's fixed schema: one dataclass per section, each key with its default, one-line meaning and
accepted values (`option`; values owned by a piece are named by import path, read when a config is checked). The
pluggable pieces' own settings join it from their registries (`config.py` derives the full schema); the keys that
choose them (`pieces.py`) are checked against those registries. A leaf: imports no other module of the trainer but
the registry's `option`, and no torch."""

from dataclasses import dataclass, field, fields, is_dataclass

from lorarl.trainer.registry import option


@dataclass
class LoraSection:
    rank: int = option(16, "LoRA rank; 0 = full fine-tuning", minimum=0)
    alpha: float = option(32.0, "LoRA alpha (scale = alpha / rank, or alpha / sqrt(rank) with rslora)")
    target_modules: list[str] = option(["all-linear"], "modules that get adapters (peft names, or all-linear: every "
                                       "linear layer but the head, and a mixture's fused experts)")  # fmt: skip
    exclude_modules: list[str] = option([], "modules never adapted (peft names or regex)")
    dropout: float = option(0.0, "dropout on the adapter input")
    rslora: bool = option(False, "rank-stabilised scaling alpha / sqrt(rank)")
    train_router: bool = option(False, "a mixture of experts: LoRA on its routers too (mlp.gate, a shared expert's "
                                "gate); frozen by default, its fused experts and shared experts adapted")  # fmt: skip
    adapter_path: str | None = option(None, "start from this saved peft adapter (its rank and alpha are used)")


@dataclass
class ModelSection:
    path: str = option("default", "a Hugging Face causal LM: a local directory, or a Hub id (org/name, through the "
                       "Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache alone); 'default' = the embedded "
                       "model, 'default-moe' its mixture of experts, 'calculator' the tool-calling one")  # fmt: skip
    revision: str | None = option(None, "branch, tag or commit of a Hub model id (None: main)")
    dtype: str = option("float32", "training weights dtype", ("float32", "bfloat16", "float16"))
    gguf_file: str | None = option(None, "a GGUF checkpoint (in model.path, or a path) to start from: dequantised "
                                   "once into a cached Hugging Face directory (needs the gguf package); model.path "
                                   "then holds its tokenizer, or the GGUF's own is used")  # fmt: skip
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class DataSection:
    train_files: list[str] = option(["default"], "prompt data: .jsonl/.json/.parquet/.csv files, `datasets` "
                                    "save_to_disk directories, glob patterns, Hub datasets (org/name: "
                                    "data.dataset_config, data.train_split); 'default' = the embedded "
                                    "task")  # fmt: skip
    val_files: list[str] = option(["default"], "validation data (same formats)")
    dataset_config: str | None = option(None, "subset of the Hub datasets named in train_files/val_files (org/name), "
                                        "e.g. main for openai/gsm8k")  # fmt: skip
    train_split: str = option("train", "the split of a Hub dataset named in train_files")
    val_split: str = option("test", "the split of a Hub dataset named in val_files")
    prompt_key: str = option("prompt", "field holding the prompt: text, or a list of chat messages (verl's schema)")
    answer_key: str = option("auto", "field (dotted path) of the reference answer given to the reward; auto: answer, "
                             "else verl's reward_model.ground_truth")  # fmt: skip
    system_prompt: str | None = option(None, "replaces the prompt's system message ('' = an empty one, overriding "
                                       "a template's default); None: as the data and template have it")  # fmt: skip
    batch_size: int = option(32, "prompts per step (each sampled rollout.n times)", minimum=1)
    max_prompt_tokens: int | None = option(None, "longer prompts are dropped (and counted); None: 512, or the room "
                                           "the model's positions leave beside rollout.max_tokens (env.max_tokens "
                                           "with an environment) where that is less", minimum=1)  # fmt: skip
    chat_template: bool = option(True, "apply the tokenizer's chat template when it has one")
    val_size: int = option(500, "validation prompts used per evaluation (0 = all)")


@dataclass
class RolloutSection:
    engine: str = option("hf", "rollout engine: hf (Hugging Face, CPU/GPU), vllm (GPU; on the CPU in vLLM's CPU "
                         "environment, made by scripts/vllm_cpu_env.sh), or a plugin's import path; its settings: "
                         "rollout.<engine>.*")  # fmt: skip
    n: int = option(8, "responses sampled per prompt (the GRPO group size)", minimum=1)
    temperature: float = option(1.0, "sampling temperature (0: greedy, one response per prompt)", minimum=0.0)
    top_p: float = option(1.0, "nucleus sampling threshold, in (0, 1]", maximum=1.0)
    max_tokens: int = option(8, "maximum response length in tokens", minimum=1)
    min_tokens: int = option(0, "training responses run at least this many tokens: end-of-sequence is removed from "
                             "the sampling distribution (and stop strings wait) until then, as vLLM's min_tokens; the "
                             "engine's log-probs are of that distribution", minimum=0)  # fmt: skip
    sync: str = option("merged", "what reaches the engine after each step (a sync kind, or a plugin's import path): "
                       "merged weights; the adapter alone (served unmerged); the LoRA factors alone (factors: the "
                       "engine merges them into its weights from a pristine copy of the adapted base weights, sent "
                       "once — that copy costs the engine their size in the trainer's dtype, or the engine's where "
                       "that holds them exactly; none inline on the HF engine, which reads the trainer's own); or "
                       "auto (measure each once)")  # fmt: skip
    dtype: str = option("auto", "the engine's weights dtype; auto: bfloat16 for a float32 model where the device "
                        "computes bfloat16 natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX; not a mixture of "
                        "experts in the HF engine on a CPU, slower in bf16 there), else model.dtype (the trainer "
                        "recomputes log-probs in model.dtype either way)",
                        ("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    bucket_mb: int = option(256, "weight-sync bucket size (MB)")
    worker: str = option("inline", "where the engine runs: in the trainer's process (weights copied in, no second "
                         "copy of the libraries; vllm: on the trainer's device, fed without a wire) or a process of "
                         "its own (fed over gloo/NCCL; needed by overlap; implied by rollout.vllm.devices)",
                         ("inline", "process"))  # fmt: skip
    overlap: bool = option(False, "generate the next batch while training on this one: one step off-policy (its "
                           "rollouts come from the weights one update behind), corrected by "
                           "algorithm.rollout_correction")  # fmt: skip
    replicas: int = option(1, "rollout engine replicas, prompts spread across them (> 1 needs trainer.backend=ray)",
                           minimum=1)  # fmt: skip
    max_staleness: int = option(0, "k > 0: the batch of step i comes from the weights of step i-k, each batch on an "
                                "engine of its own (k + 1 engines): k batches play on while the trainer trains, "
                                "corrected by algorithm.rollout_correction (0: on-policy)", minimum=0)  # fmt: skip
    in_flight_updates: bool = option(False, "with rollout.max_staleness and an environment: every turn is sampled by "
                                     "the engine holding the newest weights, so an episode takes them at its next "
                                     "turn (PipelineRL); each action keeps its version; runs do not repeat "
                                     "exactly")  # fmt: skip
    record_routes: str = option("auto", "a mixture of experts: the engine records the experts each token was routed "
                                "to, the trainer logs how often it routes them elsewhere (rollout/route_mismatch) and "
                                "algorithm.routing_replay replays them; auto: where it costs nothing to ask (the HF "
                                "engine); always: vLLM's too (enable_return_routed_experts: GPUs only); never",
                                ("auto", "always", "never"))  # fmt: skip


@dataclass
class AlgorithmSection:
    name: str = option("grpo", "preset this section started from")
    adv_estimator: str = option("grpo", "advantage estimator (algorithms/advantages.py), or a plugin's import path; "
                                "its settings: algorithm.<estimator>.*")  # fmt: skip
    policy_loss: str = option("ppo", "policy loss (algorithms/policy_losses.py), or a plugin's import path; its "
                              "settings: algorithm.<loss>.*")  # fmt: skip
    clip_low: float = option(0.2, "ratio clip below 1 (1 - clip_low), for the losses that clip", minimum=0.0,
                             maximum=1.0)  # fmt: skip
    clip_high: float = option(0.2, "ratio clip above 1 (1 + clip_high; DAPO's clip-higher raises it)", minimum=0.0)
    dual_clip: float | None = option(None, "dual-clip bound c > 1 for negative advantages (None = off)")
    loss_agg_mode: str = option("token-mean", "loss aggregation",
                                "lorarl.trainer.algorithms.aggregation:AGG_MODES")  # fmt: skip
    kl_coef: float = option(0.0, "weight of the KL to the reference policy (0 = off)")
    kl_estimator: str = option("k3", "KL estimator (algorithms/kl.py), or a plugin's import path")
    kl_in_reward: bool = option(False, "subtract the KL from the reward instead of adding a loss term")
    entropy_coef: float = option(0.0, "entropy bonus weight")
    ppo_epochs: int = option(1, "passes over each rollout batch", minimum=1)
    mini_batches: int = option(1, "optimizer steps per pass", minimum=1)
    dynamic_sampling: bool = option(False, "DAPO: drop groups whose rewards all agree, sample more prompts to refill")
    max_sampling_rounds: int = option(10, "dynamic sampling: most generation rounds per step", minimum=1)
    overlong_buffer_frac: float = option(
        0.0, "DAPO overlong penalty ramp, as a share of rollout.max_tokens (0 = off)", minimum=0.0, maximum=1.0
    )
    overlong_penalty: float = option(1.0, "overlong shaping: the penalty at rollout.max_tokens")
    mask_truncated: bool = option(False, "responses cut at rollout.max_tokens get no loss (DAPO's overlong filtering)")
    rollout_correction: str = option("none", "against the engine's mismatch: truncated IS weights (token, sequence), "
                                     "or masking tokens / rejecting sequences outside rollout_correction_band",
                                     "lorarl.trainer.algorithms.rollout_correction:CORRECTIONS")  # fmt: skip
    rollout_correction_cap: float = option(2.0, "truncation cap of the rollout-correction weights", minimum=1.0)
    rollout_correction_band: list[float] = option([0.5, 2.0], "[low, high] of the ratio kept by token_mask and "
                                                  "sequence_reject")  # fmt: skip
    routing_replay: bool = option(False, "a mixture of experts (R3): the trainer's forwards — old, reference and "
                                  "current log-probs, gradient checkpointing's recompute — route each token to the "
                                  "experts the engine chose (rollout.record_routes), weighted by the trainer's own "
                                  "router")  # fmt: skip


@dataclass
class ActorSection:
    lr: float = option(1e-3, "peak learning rate (LoRA wants ~10x a full fine-tune's)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient norm clip (0 = off)")
    warmup_steps: int = option(0, "linear warmup steps")
    lr_schedule: str = option("constant", "after warmup", ("constant", "cosine"))
    micro_batch_tokens: int = option(4096, "tokens per forward/backward, pads included (gradient accumulation "
                                     "beyond): bounds the activations' memory", minimum=1)  # fmt: skip
    layout: str = option("auto", "micro-batch layout: packed rows (for flash-attention's varlen kernel) or padded "
                         "rows of similar lengths; auto picks by the attention kernel",
                         ("auto", "packed", "padded"))  # fmt: skip
    autocast: str = option("none", "compute the training forwards and backwards in this dtype (torch.autocast), the "
                           "weights, gradients and optimizer staying in model.dtype: bfloat16 on a float32 model "
                           "where the device computes it natively (CUDA, CPUs with AVX512-BF16 or AMX) trains faster "
                           "at bf16's precision of the log-probs; none = model.dtype throughout",
                           ("none", "bfloat16", "float16"))  # fmt: skip
    gradient_checkpointing: bool = option(False, "recompute each decoder layer's activations in the backward (the "
                                          "critic's too): their memory drops to the layers' inputs, for about a "
                                          "third more compute")  # fmt: skip


@dataclass
class CriticSection:
    """The value model of estimators that use one (`algorithm.adv_estimator=gae`): a second adapter on the policy's
    base, or its own copy of the base when either is fully fine-tuned (rank 0), and a value head."""

    lora: LoraSection = field(default_factory=LoraSection)
    lr: float = option(3e-3, "learning rate of the critic's adapter and value head", minimum=0.0)
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient norm clip (0 = off)")
    warmup_steps: int = option(0, "first steps that train the critic alone (verl's critic_warmup)", minimum=0)
    cliprange_value: float | None = option(0.5, "value-loss clip around the rollout's values (None = unclipped)")


@dataclass
class RewardSection:
    fn: str = option("default", "built-in, package.module:function or path/to/file.py:function, in any of three "
                     "signatures: f(prompt, response, answer) -> float; TRL's f(prompts, completions, **columns) -> "
                     "list; verl's compute_score(data_source, solution_str, ground_truth, extra_info). Built-ins: "
                     "default (the embedded task), math (1 if the response's last \\boxed{...}, else the line "
                     "after its last ####, equals the answer's, numerically or as text; no last-number "
                     "fallback), none (0: an environment's rewards alone)")  # fmt: skip
    fns: list[str] = option([], "several reward functions (as reward.fn), summed with reward.weights; replaces fn")
    weights: list[float] = option([], "weight of each of reward.fns (default: 1 each)")
    workers: int = option(0, "processes scoring the samples (slow rewards: code execution, a judge); 0 = in the "
                          "trainer's process", minimum=0)  # fmt: skip
    timeout_s: float = option(0.0, "a reward call running longer is stopped (needs reward.workers); 0 = no limit",
                              minimum=0.0)  # fmt: skip
    on_error: str = option("raise", "a reward call that raises or times out: stop the run (naming the sample), or "
                           "score it reward.error_score and count it in reward/errors", ("raise", "score"))  # fmt: skip
    error_score: float = option(0.0, "the score of a failed reward call with reward.on_error=score")


@dataclass
class EnvSection:
    """Multi-turn episodes (`envs/`): the environment, its tools, and the bounds of an episode."""

    name: str = option("none", "the environment: none (single-turn: one response per prompt), tools (the model "
                       "calls env.tools), or a plugin's Environment subclass by import path; its settings: "
                       "env.<name>.*")  # fmt: skip
    tools: list[str] = option([], "tools the model may call: typed functions with a docstring describing their "
                              "arguments, by import path (package.module:fn, path/to/file.py:fn)")  # fmt: skip
    tool_format: str = option("hermes", "how the model writes a tool call: hermes (<tool_call>{json}</tool_call>, "
                              "Qwen-family templates) or compact (<call>name arg ...</call>)",
                              ("hermes", "compact"))  # fmt: skip
    max_turns: int = option(8, "actions per episode; an episode still going after them is truncated", minimum=1)
    max_tokens: int | None = option(None, "an episode's tokens after its prompt (actions and what the environment "
                                    "appends); one reaching it is truncated. Each action is at most "
                                    "rollout.max_tokens. None: 512, or the room the model's positions leave beside "
                                    "data.max_prompt_tokens (half of them, where that is unset too) where that is "
                                    "less", minimum=1)  # fmt: skip
    max_tool_tokens: int = option(256, "a tool message is cut to this many tokens (0 = no limit)", minimum=0)
    on_parse_error: str = option("stop", "a tool call the format cannot read: end the episode (stop reason "
                                 "parse_error), or send the error back as the tool's message",
                                 ("stop", "feedback"))  # fmt: skip
    on_error: str = option("raise", "an environment that raises or times out: stop the run (naming the episode's "
                           "data row), or end the episode scored env.error_score (counted in env/errors, "
                           "env/timeouts)",
                           ("raise", "score"))  # fmt: skip
    error_score: float = option(0.0, "the return of an episode whose environment raised or timed out, with "
                                "env.on_error=score")  # fmt: skip
    concurrency: int = option(256, "environment calls (reset, step) going on at once: a blocking call runs on one of "
                              "this many threads (sized for services — sandboxes, APIs, judges — and a step's "
                              "episodes at data.batch_size 32 x rollout.n 8; batches in flight with "
                              "rollout.max_staleness share them); async ones are awaited, this many at once per "
                              "batch; more wait their turn",
                              minimum=1)  # fmt: skip
    processes: int = option(0, "worker processes holding the episodes' environments, for CPU-heavy ones whose steps "
                            "would hold the trainer's interpreter (each episode's instance lives in one of them, "
                            "its calls run there); 0 = in the trainer's process", minimum=0)  # fmt: skip
    timeout_s: float = option(600.0, "an environment call (reset, step) taking longer ends its episode (stop reason "
                              "timeout), scored as env.on_error says; 0 = no limit", minimum=0.0)  # fmt: skip
    max_hung_calls: int = option(1024, "blocking calls given up on at env.timeout_s that never return keep their "
                                 "threads (another takes each one's place): the run stops once this many are left "
                                 "at once (env/hung_threads counts them)", minimum=1)  # fmt: skip
    batch_wait_s: float = option(0.05, "how long an episode's turn waits for others to join it in the engine's "
                                 "batch while environments are still answering (none wait once every episode "
                                 "waits)", minimum=0.0)  # fmt: skip


@dataclass
class TrainerSection:
    steps: int = option(120, "optimizer steps (rollout batches)", minimum=0)
    eval_every: int = option(10, "validate (greedy) every so many steps, and at the start and end; 0 = never")
    save_every: int = option(0, "checkpoint every so many steps (always at the end); 0 = only at the end")
    output_dir: str | None = option(None, "where outputs go (default: outputs/<date-time>)")
    seed: int = option(0, "seed for data order, sampling and initialisation")
    loggers: list[str] | None = option(None, "where metrics go besides metrics.jsonl: tensorboard, wandb (offline with "
                                       "WANDB_MODE=offline); None: tensorboard when installed")  # fmt: skip
    wandb_project: str = option("lorarl", "the wandb project of the runs")
    log_samples: int = option(0, "responses per step written to samples.jsonl (prompt, completion, score, reward, "
                              "advantage)", minimum=0)  # fmt: skip
    resume: str = option("never", "never, auto (latest checkpoint in output_dir) or a checkpoint directory")
    device: str = option("auto", "auto, cpu or cuda")
    threads: int = option(0, "torch CPU threads of each lorarl process; 0 = auto: the cores its affinity and cgroup "
                          "quota allow, fewer while other work keeps them busy (OMP_NUM_THREADS, when set, fixes "
                          "it too)", minimum=0)  # fmt: skip
    backend: str = option("local", "local (the engine where rollout.worker places it) or ray (engines as Ray "
                          "actors)", ("local", "ray"))  # fmt: skip
    n_gpus_per_node: int = option(1, "trainer ranks per node with backend=ray (a GPU each; processes on CPU)",
                                  minimum=1)  # fmt: skip
    nnodes: int = option(1, "nodes of trainer ranks with backend=ray (data-parallel size: n_gpus_per_node x nnodes)",
                         minimum=1)  # fmt: skip
    ray_address: str | None = option(None, "Ray cluster to join (e.g. auto, or host:6379); None = start a local one")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    actor: ActorSection = field(default_factory=ActorSection)
    critic: CriticSection = field(default_factory=CriticSection)
    reward: RewardSection = field(default_factory=RewardSection)
    env: EnvSection = field(default_factory=EnvSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)


def leaves(cls, prefix: str = ""):
    for f in fields(cls):
        if is_dataclass(f.type):
            yield from leaves(f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f
