"""The optimizer of a set of trainable weights (the actor's, the critic's): AdamW with a warmup-then-constant or
cosine learning rate, and a step that clips the gradient norm first."""

import math

import torch


class Optimizer:
    """AdamW over `params` with the learning-rate schedule `lr_factor(warmup, total, schedule)`."""

    def __init__(self, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, grad_clip: float,
                 warmup: int, total: int, schedule: str) -> None:  # fmt: skip
        self.params, self.grad_clip = params, grad_clip
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(warmup, total, schedule))

    def step(self) -> float:
        """Clip the gradients' norm (over every rank's shards), step, zero the gradients; returns the norm."""
        clip = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self, module: torch.nn.Module) -> dict:
        """The optimizer's full state keyed by the names of the parameters in `module`, gathered from a sharded model
        (a collective then: every rank calls it), and the schedule's: the same file resumes on any number of ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"optimizer": get_optimizer_state_dict(module, self.optimizer, options=options),
                "scheduler": self.scheduler.state_dict()}  # fmt: skip

    def load_state_dict(self, module: torch.nn.Module, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(module, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))  # fmt: skip
        self.scheduler.load_state_dict(state["scheduler"])


def lr_factor(warmup: int, total: int, schedule: str):
    """The learning rate's multiplier at each optimizer step: linear warmup, then constant or cosine to 0."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor
