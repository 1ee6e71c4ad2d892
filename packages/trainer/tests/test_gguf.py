"""A GGUF checkpoint is one key away: `model.gguf_file` dequantises it once (transformers with the gguf package) into a
cached model directory that trains, checkpoints and exports like any other — on a GGUF file the test writes itself."""

import shutil

import torch
from trainer_fixtures import make_model_dir, tiny_overrides, write_gguf
from transformers import AutoModelForCausalLM

from lorarl.trainer.cli import main
from lorarl.trainer.models import resolve_model_path

IDS = torch.tensor([[3, 4, 5, 6, 7, 8]])


def test_a_gguf_file_becomes_a_model_directory_with_the_same_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_CACHE", str(tmp_path / "cache"))
    model_dir = make_model_dir(tmp_path / "model")
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    write_gguf(model_dir)
    converted = resolve_model_path(str(model_dir), "tiny.gguf")
    assert converted.parent == tmp_path / "cache" / "gguf"
    assert (converted / "tokenizer_config.json").is_file()  # the directory's tokenizer travels with it
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(converted)(IDS).logits, original(IDS).logits,
                                   rtol=0, atol=0)  # fmt: skip
    stamp = (converted / "config.json").stat().st_mtime_ns
    assert resolve_model_path(str(model_dir), "tiny.gguf") == converted  # cached: not converted again
    assert (converted / "config.json").stat().st_mtime_ns == stamp
    write_gguf(model_dir, "tiny-q8.gguf", quantized=True)  # Q8_0 weights: dequantised, close to the original
    q8 = AutoModelForCausalLM.from_pretrained(resolve_model_path(str(model_dir), str(model_dir / "tiny-q8.gguf")))
    with torch.no_grad():
        difference = (q8(IDS).logits - original(IDS).logits).abs().max()
    assert 0 < difference < 0.05


def test_training_from_a_gguf_file_checkpoints_and_exports(tiny_setup, tmp_path, monkeypatch):
    monkeypatch.setenv("LORARL_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "gguf-model"
    shutil.copytree(tiny_setup["model"], model_dir)
    write_gguf(model_dir)
    for name in ("config.json", "model.safetensors"):  # only the GGUF file and the tokenizer are left
        (model_dir / name).unlink()
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, model__path=str(model_dir), model__gguf_file="tiny.gguf",
                               trainer__steps=3)) == 0  # fmt: skip
    checkpoint = out / "checkpoints" / "step_3"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    assert main(["export", "--checkpoint", str(checkpoint), "--merged", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_setup["model"])
    changed = [n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed  # the trained adapter, merged onto the GGUF's weights
