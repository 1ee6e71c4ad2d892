"""Bucketed weight transfer over torch.distributed into a rollout engine (see issue 4)."""
