"""Every registered channel behind one interface: each carries the updates of its forms whole, to every receiver,
exactly as sent (gloo and the shared-memory mailbox between processes; `local` within one); a form a channel does
not carry, or a receiver of another process on `local`, is refused naming it."""

import threading
from functools import partial

import pytest
import torch
from channel_workers import RECEIVERS, as_lists, coverage_updates, end, into_module, updates
from sync_processes import run_group

from lorarl.weight_sync import CHANNELS, Link, TransferError, Update, open_channel


@pytest.mark.parametrize("name", ["gloo", "ipc"])  # ipc: shared memory on the CPU, CUDA IPC on a GPU
def test_a_channel_between_processes_delivers_each_update_whole_to_every_receiver(name):
    results = run_group([partial(end, name)] * (1 + RECEIVERS), join=False)
    assert all(status == "ok" for status, _ in results.values()), results
    sent = updates(CHANNELS[name].forms)
    assert results[0][1] == [u.version for u in sent]
    for rank in range(1, 1 + RECEIVERS):
        assert results[rank][1] == [as_lists(u) for u in updates(CHANNELS[name].forms)]


def test_the_local_channel_hands_the_tensors_themselves_to_a_receiver_of_this_process():
    link = CHANNELS["local"].new_link(1, timeout=5.0)
    sender, receiver = open_channel("local", link, 0), open_channel("local", link, 1)
    for update in updates(CHANNELS["local"].forms):
        stats = sender.send(update)
        got = receiver.receive(update.form, update.version)
        if update.form != "weights":
            assert got.tensors is update.tensors  # no copy: the receiver must copy what it keeps (`hands_over`)
        assert as_lists(got) == as_lists(updates(("weights", "factors", "adapter"))[update.version - 1])
        assert stats.tensors == (5 if update.form == "weights" else len(got.tensors))  # a stream: counted as taken
    with pytest.raises(TransferError, match="no version 9 was handed over within"):
        receiver.receive("weights", 9)
    sender.send(updates(("weights",))[0])  # never taken (its receiver failed first): the next send drops it
    sender.send(updates(("factors",))[0])
    with pytest.raises(TransferError, match="no version 1 was handed over"):
        receiver.receive("weights", 1)
    assert receiver.receive("factors", 2).version == 2
    waiting = threading.Thread(target=lambda: sender.send(updates(("factors",))[0]))
    waiting.start()
    with pytest.raises(TransferError, match="handed over as factors, expected weights"):
        receiver.receive("weights", 2)
    waiting.join()


def test_what_a_channel_cannot_carry_is_refused_by_name():
    link = CHANNELS["local"].new_link(1)
    with pytest.raises(ValueError, match="the 'local' channel reaches one receiver"):
        open_channel("local", Link(port=link.port, receivers=2), 0)
    with pytest.raises(ValueError, match="unknown channel 'carrier-pigeon': expected one of gloo, nccl, ipc, local"):
        open_channel("carrier-pigeon", link, 0)
    with pytest.raises(ValueError, match="an adapter update carries its peft config"):
        Update("adapter", 1, {})
    with pytest.raises(ValueError, match="a factors update is a mapping"):
        Update("factors", 1, iter([]))
    assert CHANNELS["ipc"].forms == ("weights", "factors")  # adapters go as files: over a wire or in-process


@pytest.mark.parametrize("name", ["gloo", "local"])
def test_a_subset_update_leaves_the_other_weights_and_a_full_one_must_hold_them_all(name):
    """An update's coverage travels with it: a subset loads into a module that has more weights, the others kept;
    the same tensors announced as the full model are refused before anything is applied."""
    if name == "local":
        link = CHANNELS["local"].new_link(1, timeout=5.0)
        sender, receiver = open_channel("local", link, 0), open_channel("local", link, 1)
        module = torch.nn.Sequential()
        module.layers = torch.nn.ModuleList(torch.nn.Linear(2, 3, bias=False) for _ in range(3))
        outcomes = []
        for update in coverage_updates():
            sender.send(update)
            try:
                outcomes.append(receiver.load_into(module, update.version))
            except ValueError as error:
                outcomes.append(str(error).split(":")[0])
        received = [[outcomes, [layer.weight[0, 0].item() for layer in module.layers]]]
    else:
        results = run_group([partial(into_module, name)] * (1 + RECEIVERS), join=False)
        assert [status for status, _ in results.values()] == ["ok"] * (1 + RECEIVERS), results
        assert results[0][1][:2] == [1, 2]
        received = [results[rank][1] for rank in range(1, 1 + RECEIVERS)]
    for outcomes, weights in received:
        assert outcomes[:2] == [1, 2]
        assert "version 3 does not fit the target, nothing applied" in outcomes[2]
        assert weights == [0.0, 10.0, 2.0]  # layer 1 from the subset, the others from version 1
