"""A checkpoint appears whole or not at all: a save stopped part-way (a second Ctrl-C, a full disk) leaves no partial
directory, and resuming finds the last complete one."""

import pytest
import torch

from lorarl.trainer.checkpoint import STATE, latest, save


def write_adapter(directory):
    torch.save({"w": torch.ones(2)}, directory / "adapter.pt")


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_a_save_stopped_part_way_leaves_the_last_complete_checkpoint_and_nothing_else(tmp_path, stop):
    first = save(tmp_path, 1, write_adapter, state={"optimizer": {}}, config_yaml="a: 1\n")

    def stopped(directory):
        write_adapter(directory)
        raise stop

    with pytest.raises(type(stop)):
        save(tmp_path, 2, stopped, state={"optimizer": {}}, config_yaml="a: 1\n")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert latest(tmp_path) == first
    assert torch.load(first / STATE, weights_only=False)["step"] == 1
