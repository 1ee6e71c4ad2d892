"""lorarl's weight-transfer engine inside a real vLLM engine (vLLM's CPU build), driven by vLLM's RL API: after each
version the engine generates what transformers generates with the same weights, with the same log-probs, and reports
the version; a transfer that fails part-way — the sender killed, a corrupted bucket — changes nothing (the previous
version serves on, and a later one applies); an update that fails while being applied makes the engine refuse to
generate until a version is applied whole."""

import pytest
import torch
from vllm_cpu_helpers import (
    SenderProcess,
    assert_greedy_and_logprobs_match,
    greedy,
    hf_model,
    make_model_dir,
    start_engine,
)

from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.engines.vllm_worker import VllmServing
from lorarl.weight_sync import TransferError, Update
from lorarl.weight_sync.vllm import INCOMPLETE, OfflineClient, VllmWeightTransfer, update_round

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY_4 = SamplingParams(n=1, temperature=0.0, max_tokens=4)


def perturbed(model, seed: int, *, embeddings: bool) -> dict[str, torch.Tensor]:
    """A new version of the weights: every tensor moved a little (the embedding too, with `embeddings`)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if "embed_tokens" in name and not embeddings:
            state[name] = tensor.clone()
        else:
            state[name] = tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
    return state


@pytest.fixture(scope="module", params=["tied", "untied"])
def model_dir(request, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(request.param), tie=request.param == "tied")


def test_versions_sent_in_process_serve_what_transformers_computes(model_dir):
    llm = start_engine(model_dir)
    try:
        transfer = VllmWeightTransfer(OfflineClient(llm), channel="local")
        base = hf_model(model_dir)
        assert {s.version for out in greedy(llm, PROMPTS) for s in out.weight_versions} == {"default"}
        for version in (1, 2, 3):
            # the embedding changes in versions 1 and 3: a tied LM head must serve it (vLLM's CPU backend keeps a
            # prepacked GEMM of the head's own, which its layerwise reload must process again)
            state = perturbed(base, version, embeddings=version != 2)
            stats = transfer.send(Update("weights", version, state))
            assert (stats.version, stats.tensors) == (version, len(state))
            assert llm.get_weight_version() == str(version)
            llm.reset_prefix_cache()
            assert_greedy_and_logprobs_match(llm, hf_model(model_dir, state), PROMPTS, version=str(version))
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_over_gloo_a_killed_sender_or_a_corrupt_bucket_leaves_the_previous_version_serving(model_dir):
    llm = start_engine(model_dir)
    client = OfflineClient(llm)
    base = hf_model(model_dir)
    senders = []

    def connect() -> SenderProcess:
        senders.append(SenderProcess.joined_by(client))
        return senders[-1]

    def update(sender, version, state, fault=None):
        sender.send(version, state, fault)
        return update_round(client, {"version": version}, version)

    try:
        sender = connect()
        v1 = perturbed(base, 1, embeddings=True)
        update(sender, 1, v1)
        assert sender.result()[0] == "ok"
        assert_greedy_and_logprobs_match(llm, hf_model(model_dir, v1), PROMPTS, version="1")

        with pytest.raises(TransferError, match="corrupted"):  # the same channel serves on afterwards
            update(sender, 2, perturbed(base, 2, embeddings=True), fault="corrupt")
        assert sender.result()[0] == "error"
        assert llm.get_weight_version() == "1"
        assert_greedy_and_logprobs_match(llm, hf_model(model_dir, v1), PROMPTS, version="1")
        v3 = perturbed(base, 3, embeddings=True)
        update(sender, 3, v3)
        assert sender.result()[0] == "ok"
        llm.reset_prefix_cache()
        assert_greedy_and_logprobs_match(llm, hf_model(model_dir, v3), PROMPTS, version="3")

        with pytest.raises(TransferError):  # the peer is gone: noticed within the group's timeout
            update(sender, 4, perturbed(base, 4, embeddings=True), fault="die")
        assert sender.result(timeout=5) is None  # it died
        assert llm.get_weight_version() == "3"
        assert_greedy_and_logprobs_match(llm, hf_model(model_dir, v3), PROMPTS, version="3")

        sender = connect()  # a trainer that comes back joins afresh
        v5 = perturbed(base, 5, embeddings=False)
        update(sender, 5, v5)
        assert sender.result()[0] == "ok"
        llm.reset_prefix_cache()
        assert_greedy_and_logprobs_match(llm, hf_model(model_dir, v5), PROMPTS, version="5")
    finally:
        for sender in senders:
            sender.close()
        llm.llm_engine.engine_core.shutdown()


def test_a_version_that_fails_while_applied_makes_the_engine_refuse_until_one_applies_whole(tmp_path):
    directory = make_model_dir(tmp_path / "m", tie=True)
    llm = start_engine(directory)
    serving = VllmServing(llm)
    try:
        transfer = VllmWeightTransfer(OfflineClient(llm), channel="local")
        base = hf_model(directory)
        v1 = perturbed(base, 1, embeddings=True)
        serving.update(lambda: transfer.send(Update("weights", 1, v1)), 1)
        bad = perturbed(base, 2, embeddings=True) | {"model.layers.0.mlp.no_such_proj.weight": torch.zeros(4, 4)}
        with pytest.raises(RuntimeError, match=INCOMPLETE):
            serving.update(lambda: transfer.send(Update("weights", 2, bad)), 2)
        with pytest.raises(Exception, match="refuses to generate"):
            serving.generate(PROMPTS, GREEDY_4)
        assert serving.version == 1
        v3 = perturbed(base, 3, embeddings=True)
        serving.update(lambda: transfer.send(Update("weights", 3, v3)), 3)
        assert {c.version for c in serving.generate(PROMPTS, GREEDY_4)} == {3}
        assert_greedy_and_logprobs_match(llm, hf_model(directory, v3), PROMPTS, version="3")
    finally:
        serving.close()


def test_a_transfer_that_announces_another_version_changes_nothing(tmp_path):
    directory = make_model_dir(tmp_path / "m", tie=False)
    llm = start_engine(directory)
    client = OfflineClient(llm)
    sender = SenderProcess.joined_by(client)
    try:
        sender.send(7, perturbed(hf_model(directory), 7, embeddings=True))
        with pytest.raises(TransferError, match="announced version 6 but sent version 7"):
            update_round(client, {"version": 6}, 6)
        assert llm.get_weight_version() == "default"
        assert_greedy_and_logprobs_match(llm, hf_model(directory), PROMPTS, version="default")
    finally:
        sender.close()
        llm.llm_engine.engine_core.shutdown()
