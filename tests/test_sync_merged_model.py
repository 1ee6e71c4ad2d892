"""lora_merge -> weight_sync -> an HF model in another process: ends bit-identical to peft's merge_and_unload()."""

from functools import partial

import pytest
import sync_e2e_workers as e2e
from sync_processes import run_group


@pytest.mark.parametrize(
    ("bucket_bytes", "direct_bytes"),
    [(16 << 10, 2048), (64 << 20, 1 << 20)],  # many buckets, split and direct tensors; everything in one bucket
)
def test_merged_weights_stream_into_an_engine_model_bit_identical_to_peft(bucket_bytes, direct_bytes):
    trainer = partial(e2e.trainer, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes)
    out = run_group([trainer, e2e.engine], deadline=120)
    assert out[0][0] == "ok", out[0][1]
    assert out[1][0] == "ok", out[1][1]
    sent, got = out[0][1], out[1][1]
    assert got["version"] == 1
    assert got["state"] == sent["reference"]  # every tensor, bit for bit, tied lm_head included
    tensors, buckets = sent["stats"]
    assert tensors == len(sent["reference"])
    assert buckets > 1 if bucket_bytes < 1 << 20 else buckets == 1
