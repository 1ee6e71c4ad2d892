"""`rollout.min_tokens` on the real vLLM CPU engine: responses of the embedded model, which answers in a few tokens,
run to the minimum, and the engine's log-probs are those of the distribution it drew from (end-of-sequence removed,
the rest renormalised), as lorarl's HF engine reports them (test_decode)."""

import torch
from vllm_cpu_helpers import LOGPROB_TOLERANCE, engine_settings, hf_model

from lorarl.trainer import default_task
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.engines.vllm_worker import VllmWorker
from lorarl.trainer.models import load_tokenizer

MODEL = default_task.MODEL_DIR


def test_min_tokens_runs_responses_on_with_the_renormalised_log_probs():
    tokenizer = load_tokenizer(MODEL)
    eos = tokenizer.eos_token_id
    prompts = [tokenizer.encode(p["prompt"]) for p in default_task.problems(4, validation=True, seed=0)]
    engine = VllmWorker(engine_settings(MODEL))
    try:
        free = engine.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=1))
        held = engine.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=1, min_tokens=12))
    finally:
        engine.close()
    assert sum(c.finished for c in free) >= 6  # the model ends its answers early on its own
    reference = hf_model(MODEL)
    for completion in held:
        tokens = list(completion.token_ids)
        assert len(tokens) == 12
        assert eos not in tokens
        assert not completion.finished
        prompt = prompts[completion.prompt_index]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
        logits[:, eos] = float("-inf")
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), want,
                                   atol=LOGPROB_TOLERANCE, rtol=0)  # fmt: skip
