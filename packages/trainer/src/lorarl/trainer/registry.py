"""A name → function table that config choices, presets and `--help` read, so that a new estimator, loss or engine is
one decorated function (or class) and nothing else to edit."""

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind (`kind` names it in errors), in registration order. Iterating yields the names, so a
    registry serves as a config key's `choices`: a name registered later is accepted as well."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator adding the decorated object under `name`; a name is registered once."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered already")
            self._entries[name] = entry
            return entry

        return add

    def remove(self, name: str) -> T:
        """Take `name` out again (a plugin unloaded, a test's toy entry) and return what it held."""
        entry = self[name]  # an unknown name: the same error as a lookup
        del self._entries[name]
        return entry

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), self._entries, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}: expected one of {', '.join(self._entries)}{hint}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
