"""A v1 taskset laid out as verifiers documents a taskset package of its own: the id `letter-count` names the module
`letter_count`, which exports one `Taskset`."""

from letter_count.taskset import LetterCountTaskset

__all__ = ["LetterCountTaskset"]
