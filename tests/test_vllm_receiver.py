"""The vLLM receiving side against vLLM's own model classes (built on CPU; vLLM engines cannot start here)."""

import math
from functools import partial

import numpy as np
import torch
import vllm_workers as v
from sync_processes import run_group

from lorarl.weight_sync import free_port


def test_extension_loads_merged_weights_into_vllms_qwen2_fusing_qkv_and_gate_up():
    out = run_group([v.trainer, partial(v.engine, dist_port=free_port())], join=False, deadline=240)
    assert out[0][0] == "ok", out[0][1]
    assert out[1][0] == "ok", out[1][1]
    expected = out[0][1]
    version, state = out[1][1]
    assert version == 5
    assert set(state) == set(expected)  # every vLLM parameter was filled (lm_head is tied to embed_tokens)
    for name, array in expected.items():
        assert np.array_equal(state[name], array), name


def test_extension_loads_weights_handed_over_in_process_for_a_colocated_engine():
    out = run_group([v.colocated], join=False, deadline=240)
    assert out[0][0] == "ok", out[0][1]
    (tensors, nbytes), expected, state = out[0][1]
    assert tensors > 0
    assert nbytes > 0
    assert set(state) == set(expected)
    for name, array in expected.items():
        assert np.array_equal(state[name], array), name


def test_extension_loads_shared_buckets_as_tensor_parallel_workers_of_a_colocated_engine_do():
    out = run_group([v.shared_trainer, partial(v.shared_engine, dist_port=free_port())], join=False, deadline=240)
    assert out[0][0] == "ok", out[0][1]
    assert out[1][0] == "ok", out[1][1]
    posted, expected = out[0][1]
    loaded, state = out[1][1]
    assert all(buckets > 3 for _, _, buckets in posted)  # many small buckets, each version in one load_weights
    assert [tuple(x) for x in loaded] == [(6, *posted[0][:2]), (7, *posted[1][:2])]
    assert set(state) == set(expected)
    for name, array in expected.items():  # the second version, with the changed adapter
        assert np.array_equal(state[name], array), name


def test_colocated_engine_syncs_through_shared_buckets_and_refuses_to_generate_after_a_failed_sync():
    from tiny_models import tiny_lora_qwen2

    from lorarl.lora_merge import merged_weight_specs

    out = run_group([v.colocated_engine], join=False, deadline=240)
    assert out[0][0] == "ok", out[0][1]
    (version, tensors, nbytes, buckets), engine_version, errors, state, expected = out[0][1]
    specs = merged_weight_specs(tiny_lora_qwen2())
    assert (version, tensors, nbytes) == (3, len(specs), sum(math.prod(shape) * dtype.itemsize
                                                               for _, shape, dtype in specs))  # fmt: skip
    assert buckets > 3
    for name, array in expected.items():
        assert np.array_equal(state[name], array), name
    assert engine_version == 3  # the failed version 4 is not reported
    assert errors[0] == "RuntimeError: the merge failed"
    assert errors[1].startswith("EngineError: the colocated engine holds half-loaded weights (the sync of version 4")


def test_extension_writes_a_received_adapter_that_peft_loads(tmp_path):
    from peft import PeftModel
    from tiny_models import tiny_qwen2

    engine = partial(v.adapter_engine, dist_port=free_port(), directory=str(tmp_path))
    out = run_group([v.adapter_trainer, engine], join=False, deadline=240)
    assert out[0][0] == "ok", out[0][1]
    assert out[1][0] == "ok", out[1][1]
    version, directory = out[1][1]
    assert version == 2
    loaded = PeftModel.from_pretrained(tiny_qwen2(dtype=torch.bfloat16), directory)
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(loaded)
    assert set(state) == set(out[0][1])
    for name, array in out[0][1].items():
        assert np.array_equal(state[name].float().numpy(), array), name


def test_trainer_side_driver_joins_every_worker_and_sends_versions():
    out = run_group([partial(v.driver, dist_port=free_port())], join=False, deadline=240)
    assert out[0][0] == "ok", out[0][1]
    versions, state, expected = out[0][1]
    assert versions == [1, 2]
    for name, array in expected.items():
        assert np.array_equal(state[name], array), name
