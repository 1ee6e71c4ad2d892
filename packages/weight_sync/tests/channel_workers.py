"""The ends of a channel, each in a process of its own (spawned): the sender sends every update of `updates()`, each
receiver returns what it received, as plain lists."""

import torch

from lorarl.weight_sync import Link, Update, open_channel

RECEIVERS = 2


def updates(forms: tuple[str, ...]) -> list[Update]:
    """Version 1 as a stream of weights with its manifest, 2 as a factor-set-shaped mapping, 3 as an adapter: the
    forms the channel carries."""
    generator = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(64, 33, generator=generator) for i in range(4)}
    weights["layer0.bias"] = torch.arange(7, dtype=torch.bfloat16)
    manifest = [(name, t.shape, t.dtype) for name, t in weights.items()]
    factors = {"a.lora_A": torch.ones(2, 5), "a.lora_scale": torch.tensor(0.5, dtype=torch.float64)}
    adapter = {"q.lora_A.weight": torch.full((2, 3), 3.0)}
    made = [Update("weights", 1, iter(list(weights.items())), manifest), Update("factors", 2, factors),
            Update("adapter", 3, adapter, config={"r": 2, "lora_alpha": 4})]  # fmt: skip
    return [update for update in made if update.form in forms]


def as_lists(update: Update) -> tuple:
    return update.form, update.version, [(n, t.dtype, t.tolist()) for n, t in update.named()], update.config


def end(name: str, port: int, rank: int) -> list:
    channel = open_channel(name, Link(port=port, receivers=RECEIVERS, timeout=20.0), rank)
    try:
        if rank == 0:
            return [channel.send(update).version for update in updates(channel.forms)]
        return [as_lists(channel.receive(update.form, update.version)) for update in updates(channel.forms)]
    finally:
        channel.close()


def coverage_updates() -> list[Update]:
    """Version 1: every weight of `Layers`; 2: one layer alone, a subset; 3: the same layer announced as the full
    model (a receiver must refuse it: the others would be missing)."""
    full = {f"layers.{i}.weight": torch.full((3, 2), float(i)) for i in range(3)}
    one = {"layers.1.weight": torch.full((3, 2), 10.0)}
    return [Update("weights", 1, full), Update("weights", 2, one, coverage="subset"), Update("weights", 3, one)]


def into_module(name: str, port: int, rank: int) -> list:
    """The sender sends `coverage_updates()`; each receiver loads them into a module of three layers: what each
    load did (its version, or its error), and the weights it ends with."""
    channel = open_channel(name, Link(port=port, receivers=RECEIVERS, timeout=20.0), rank)
    try:
        if rank == 0:
            outcomes = []
            for update in coverage_updates():
                try:
                    outcomes.append(channel.send(update).version)
                except Exception as error:  # a receiver refused it
                    outcomes.append(type(error).__name__)
            return outcomes
        module = torch.nn.Sequential()
        module.layers = torch.nn.ModuleList(torch.nn.Linear(2, 3, bias=False) for _ in range(3))
        outcomes = []
        for update in coverage_updates():
            try:
                outcomes.append(channel.load_into(module, update.version))
            except Exception as error:
                outcomes.append(str(error).split(":")[0])
        return [outcomes, [layer.weight[0, 0].item() for layer in module.layers]]
    finally:
        channel.close()
