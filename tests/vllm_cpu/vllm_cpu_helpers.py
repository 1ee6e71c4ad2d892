"""Helpers of the tests against the real vLLM engine (vLLM's CPU build, run in its own environment): tiny models on
disk, an engine in this process with lorarl's weight-transfer backend, a trainer-side sender in a process of its own
(faults injected on demand), and the references — transformers' forward pass and its greedy choice."""

import os
import signal
import traceback
from pathlib import Path

import torch
from sync_processes import CONTEXT  # forked from a server that imported torch once
from trainer_fixtures import tiny_overrides

from lorarl.trainer import default_task
from lorarl.trainer.engines.vllm_worker import VllmSettings, start_llm
from lorarl.weight_sync import BucketSender, create_sync_group, free_port
from lorarl.weight_sync.protocol import CONTROL_BYTES

TIMEOUT = 20.0  # the sync groups' timeout: a dead peer is noticed well within it


def make_model_dir(directory: Path, *, tie: bool, seed: int = 0) -> Path:
    """A random Qwen2 with head size 32 (what vLLM's CPU attention takes), tied or untied embeddings, and the
    embedded task's character tokenizer beside it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = default_task.build_tokenizer(vocab_size=96)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=tie, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.15)  # logits spread beyond near-ties
    if not tie:
        torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.15)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def trainer_overrides(setup: dict[str, str], output_dir: Path, **extra) -> list[str]:
    """The trainer tests' short run (`trainer_fixtures.tiny_overrides`) with vLLM as its engine, in float32."""
    return tiny_overrides(setup, output_dir, rollout__engine="vllm", rollout__dtype="float32",
                          rollout__vllm__kv_cache_gb=0.25, **extra)  # fmt: skip


def engine_settings(model_dir: Path, *, max_lora_rank: int | None = None) -> VllmSettings:
    """vLLM (float32) on the CPU, as the trainer configures it."""
    return VllmSettings(str(model_dir), torch.float32, 1, 0.5, None, seed=0, max_lora_rank=max_lora_rank,
                        devices=None, device="cpu", kv_cache_gb=0.25)  # fmt: skip


def start_engine(model_dir: Path, *, max_lora_rank: int | None = None):
    """vLLM on the CPU in this process, with lorarl's weight-transfer backend (`engine_settings`)."""
    return start_llm(engine_settings(model_dir, max_lora_rank=max_lora_rank))


def hf_model(model_dir: Path, state: dict[str, torch.Tensor] | None = None):
    """transformers' model of `model_dir`, with `state` loaded over its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        _, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    return model


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probs of `tokens` after `prompt` (one forward pass), and how far each token's logit lies
    below the best logit at its position (0 where it is the greedy choice)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    picked = torch.tensor(tokens)[:, None]
    logprobs = torch.log_softmax(logits, -1).gather(1, picked)[:, 0]
    below_best = logits.max(-1).values - logits.gather(1, picked)[:, 0]
    return logprobs, below_best


def greedy(llm, prompts: list[list[int]], max_tokens: int = 8, lora_request=None) -> list:
    """The engine's greedy completions (CompletionOutput: token ids, log-probs, weight versions)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora_request,
                           use_tqdm=False)  # fmt: skip
    return [o.outputs[0] for o in outputs]


def assert_greedy_and_logprobs_match(llm, reference, prompts, *, version: str, lora_request=None) -> float:
    """The engine's greedy completions are transformers' greedy choices (each token the best logit at its step, up
    to float32 noise: a near-tie may go either way), their log-probs transformers' within `LOGPROB_TOLERANCE`, and
    vLLM records `version` for them. Returns the largest log-prob difference."""
    worst = 0.0
    for prompt, out in zip(prompts, greedy(llm, prompts, lora_request=lora_request), strict=True):
        tokens = list(out.token_ids)
        assert tokens, "the engine generated nothing"
        expected, below_best = token_logprobs(reference, prompt, tokens)
        assert (below_best <= 1e-4).all(), (prompt, tokens, below_best.tolist())
        got = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)], dtype=torch.double)
        worst = max(worst, (got - expected).abs().max().item())
        assert {span.version for span in out.weight_versions} == {version}, out.weight_versions
    assert worst <= LOGPROB_TOLERANCE, worst
    return worst


LOGPROB_TOLERANCE = 2e-4  # float32 engine against float32 transformers; measured up to ~2e-5 on these models


# --- a trainer's sender in a process of its own ------------------------------------------------------------------


class SenderProcess:
    """Rank 0 of a gloo sync group in a process of its own, sending what it is told: `send(version, tensors,
    fault)` with fault None, "corrupt" (one flipped byte on the wire, after the checksums) or "die" (SIGKILL in the
    second bucket)."""

    def __init__(self, port: int, workers: int = 1):
        self.conn, child = CONTEXT.Pipe()
        self.process = CONTEXT.Process(target=_sender_main, args=(child, port, workers + 1), daemon=True)
        self.process.start()

    @classmethod
    def joined_by(cls, client) -> "SenderProcess":
        """A sender whose sync group the engine behind `client` (vLLM's weight-sync calls) joins, as one worker."""
        port = free_port()
        sender = cls(port)
        client.init_weight_transfer_engine({"channel": "gloo", "port": port, "world_size": 2, "rank_offset": 1,
                                            "timeout": TIMEOUT})  # fmt: skip
        return sender

    def send(self, version: int, tensors: dict[str, torch.Tensor], fault: str | None = None) -> None:
        self.conn.send((version, {k: v.contiguous() for k, v in tensors.items()}, fault))

    def result(self, timeout: float = 60.0):
        """("ok", stats) or ("error", text); None if the process died."""
        if not self.conn.poll(timeout):
            raise TimeoutError("the sender did not answer")
        try:
            return self.conn.recv()
        except EOFError:
            return None

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def _sender_main(conn, port: int, world: int) -> None:
    group = create_sync_group("127.0.0.1", port, world, 0, timeout=TIMEOUT)
    sender = BucketSender(group, bucket_bytes=64 << 10, direct_bytes=16 << 10, timeout=TIMEOUT, verify=True)
    broadcast = sender.wire.broadcast
    while True:
        try:
            version, tensors, fault = conn.recv()
        except EOFError:
            return
        faulty = {"corrupt": corrupting, "die": dying}.get(fault)
        sender.wire.broadcast = faulty(broadcast) if faulty else broadcast
        try:
            stats = sender.send(tensors, version=version, manifest=[(n, t.shape, t.dtype) for n, t in tensors.items()])
            conn.send(("ok", (stats.tensors, stats.bytes, stats.buckets)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def at_second_bucket(broadcast, fault):
    """The channel's broadcast, with `fault(tensor)` applied to the second bucket's first data message (the one after
    its header: the checksums)."""
    seen = {"controls": 0, "since_control": 0}

    def send(tensor):
        if tensor.numel() == CONTROL_BYTES:
            seen["controls"] += 1
            seen["since_control"] = 0
        else:
            seen["since_control"] += 1
        if seen["controls"] == 2 and seen["since_control"] == 1:
            tensor = fault(tensor)
        return broadcast(tensor)

    return send


def corrupting(broadcast):
    """One byte of the second bucket flipped on the wire, after its checksum."""

    def flip(tensor):
        tensor = tensor.clone()
        tensor[tensor.numel() // 2] ^= 1
        return tensor

    return at_second_bucket(broadcast, flip)


def dying(broadcast):
    """This process killed in the middle of the second bucket, as a crashed trainer is."""
    return at_second_bucket(broadcast, lambda tensor: os.kill(os.getpid(), signal.SIGKILL))
