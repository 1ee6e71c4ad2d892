"""Registries of the pluggable pieces (advantage estimators, policy losses, KL estimators, rollout engines, rewards).

Each entry is a typed `Plugin`: its function (or class), its metadata as fields, and the dataclass of its own settings,
which the config schema places under the entry's name (`algorithm.clip_cov.ratio`) and `--help` lists with it. A config
chooses an entry by name, or loads one by import path (`package.module:name` or `path/to/file.py:name`): a plugin is
one decorated object in the user's own file, nothing else to edit."""

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import io
import pickle
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar


def option(default, help: str, choices: Iterable | None = None, *, minimum: float | None = None,
           maximum: float | None = None):  # fmt: skip
    """A config key (of a section, or of a plugin's settings): its default, one-line meaning, and the values it
    accepts (choices — a tuple, a registry, whose names are read when a config is checked, or the import path of a
    tuple that a piece owns, `module:NAME` — or an inclusive range); `--help` shows them."""
    meta = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def choices_of(key: Any) -> Iterable | None:
    """The values a key (a dataclass field made by `option`) accepts, if it names them (an import path: imported)."""
    choices = key.metadata.get("choices")
    return import_object(choices) if isinstance(choices, str) else choices


@dataclass(frozen=True)
class Plugin:
    """One registry entry. Calling it calls `target`."""

    name: str
    target: Any  # the function, or the class of an engine
    settings: type | None = None  # the dataclass of its own settings (None: it has none)

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)

    @property
    def origin(self) -> str:
        """Where it comes from, as a config names it: `package.module:name`, or `path/to/file.py:name` for a plugin
        file's."""
        if isinstance(self.target, str):
            return self.target
        module = sys.modules.get(getattr(self.target, "__module__", ""))
        path = next((p for p, m in _FILE_MODULES.items() if m is module), None)
        name = getattr(self.target, "__qualname__", self.name)
        return f"{path}:{name}" if path is not None else f"{self.target.__module__}:{name}"

    @property
    def summary(self) -> str:
        """Its docstring's first paragraph, on one line, cut to 90 characters."""
        text = " ".join((self.target.__doc__ or "").strip().split("\n\n")[0].split())
        return text if len(text) <= 90 else text[:89] + "…"

    def keywords(self, given: Any = None) -> dict:
        """Its settings as keywords: `given` (its settings dataclass, or a dict of some of them), the defaults for the
        rest."""
        if dataclasses.is_dataclass(given):
            given = dataclasses.asdict(given)
        given = dict(given or {})
        names = [f.name for f in dataclasses.fields(self.settings)] if self.settings is not None else []
        if unknown := set(given) - set(names):
            raise ValueError(f"{self.name} has no settings {sorted(unknown)} (its settings: {names or 'none'})")
        return {**(dataclasses.asdict(self.settings()) if self.settings is not None else {}), **given}

    def settings_in(self, section: Any) -> Any:
        """Its settings object, read from the config section that holds them (`section.<name>`; None: it has none)."""
        return getattr(section, self.name) if self.settings is not None else None

    def configured(self, section: Any) -> dict:
        """Its settings as keywords, read from the config section that holds them."""
        return self.keywords(self.settings_in(section))


P = TypeVar("P", bound=Plugin)


class PluginError(ValueError):
    """A registry name or import path that names no usable entry: says which, and what is expected."""


class Registry(Generic[P]):
    """The entries of one kind (`kind` names it in errors), each of type `entry_type`, in registration order.
    Iterating yields the names; `in` and `[]` also accept import paths, so a registry serves as a config key's
    choices."""

    def __init__(self, kind: str, entry_type: type[P] = Plugin, *, keywords: dict[str, str] | None = None):
        self.kind, self.entry_type = kind, entry_type
        self.keywords = dict(keywords or {})  # names a config may give besides the entries', with their meaning
        self._entries: dict[str, P] = {}
        self._imported: dict[str, P] = {}  # import path -> the entry it named
        self._by_target: dict[Any, P] = {}  # a registered function or class -> its (first) entry

    def register(self, name: str, **fields) -> Callable[[Any], Any]:
        """A decorator registering the decorated function or class under `name`, with the entry's `fields`
        (`settings=...` and the kind's metadata). A name is registered once."""
        known = {f.name for f in dataclasses.fields(self.entry_type)} - {"name", "target"}
        if unknown := set(fields) - known:
            raise TypeError(f"{self.kind} {name!r}: unknown fields {sorted(unknown)}; expected some of {sorted(known)}")
        settings = fields.get("settings")
        if settings is not None and not dataclasses.is_dataclass(settings):
            raise TypeError(f"{self.kind} {name!r}: settings must be a dataclass, got {settings!r}")

        def add(target: Any) -> Any:
            if name in self._entries and not _same_source(self._entries[name].target, target):
                raise ValueError(f"{self.kind} {name!r} is registered already")
            entry = self.entry_type(name=name, target=target, **fields)
            self._entries[name] = entry
            self._by_target.setdefault(target, entry)
            return target  # unchanged: a function stays a function, a class a class (picklable, subclassable)

        return add

    def remove(self, name: str) -> P:
        """Take `name` out again (a plugin unloaded, a test's toy entry) and return what it held."""
        entry = self[name]  # an unknown name: the same error as a lookup
        del self._entries[name]
        self._imported = {path: e for path, e in self._imported.items() if e is not entry}
        self._by_target = {target: e for target, e in self._by_target.items() if e is not entry}
        return entry

    def entries(self) -> list[P]:
        return list(self._entries.values())

    def __getitem__(self, spec: "str | P") -> P:
        """The entry registered as `spec`, or the one the import path `spec` names (imported once); an entry is its
        own answer (callers take a name or the entry they already hold)."""
        if isinstance(spec, self.entry_type):
            return spec
        if spec in self._entries:
            return self._entries[spec]
        if isinstance(spec, str) and ":" in spec:
            if spec not in self._imported:
                self._imported[spec] = self._load(spec)
            return self._imported[spec]
        close = difflib.get_close_matches(str(spec), self._entries, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        names = ", ".join([*self._entries, *self.keywords])
        raise PluginError(f"unknown {self.kind} {spec!r}: expected one of {names}, or an import "
                          f"path (package.module:name or path/to/file.py:name){hint}")  # fmt: skip

    def entry_of(self, target: Any) -> P | None:
        """The entry `target` (a function or class) is registered as, if any."""
        try:
            return self._by_target.get(target)
        except TypeError:  # not hashable: not registered
            return None

    def _load(self, spec: str) -> P:
        if spec in self._by_target:  # an entry registered by its import path (imported when used)
            return self._by_target[spec]
        found = import_object(spec)
        if (entry := self.entry_of(found)) is not None:
            return entry
        raise PluginError(f"{getattr(found, '__name__', spec)} is not a registered {self.kind}: decorate it with the "
                          f"{self.kind}'s register decorator (see the trainer's README, Plugins)")  # fmt: skip

    def __contains__(self, spec: object) -> bool:
        try:
            self[spec]
        except PluginError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


_FILE_MODULES: dict[Path, Any] = {}  # plugin files loaded by path, once each (their decorators register once)


def import_object(spec: str) -> Any:
    """The object `package.module:name` or `path/to/file.py:name` names."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise PluginError(f"file {target} not found")
            module = _import_file(path)
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise PluginError(f"cannot import {target}: {e}") from None
    except Exception as e:  # the module's own error (a SyntaxError, a NameError at its top level): one line
        raise PluginError(f"cannot import {target}: {type(e).__name__}: {e}{_where(e)}") from None
    if not hasattr(module, name):
        raise PluginError(f"{target} has no {name!r}")
    return getattr(module, name)


def _where(error: Exception) -> str:
    """Where `error` was raised, as " (file, line N)" (a SyntaxError says so itself)."""
    if isinstance(error, SyntaxError):
        return ""
    frames = traceback.extract_tb(error.__traceback__)
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def _import_file(path: Path) -> Any:
    """The module of a plugin file, under a name derived from its path: the same name in every process that loads
    it, which is what pickles of its objects refer to."""
    if path not in _FILE_MODULES:
        module_name = f"lorarl_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        _FILE_MODULES[path] = module
    return _FILE_MODULES[path]


def plugin_modules() -> list[Any]:
    """The modules of the plugin files loaded so far (for Ray, which pickles their objects by value)."""
    return list(_FILE_MODULES.values())


class Portable:
    """`value` (e.g. a plugin engine's class and settings) pickled for a process spawned from this one: unpickling
    it there first loads the plugin files whose objects it holds, which that process could not import by name."""

    def __init__(self, value: Any):
        self.value = value

    def __reduce__(self):
        buffer = io.BytesIO()
        pickler = _ModuleNoter(buffer)
        pickler.dump(self.value)
        files = [str(path) for path, module in _FILE_MODULES.items() if module.__name__ in pickler.modules]
        return _unpickle_with_plugins, (files, buffer.getvalue())


class _ModuleNoter(pickle.Pickler):
    """A pickler that notes the modules of the classes and functions it pickles (by name)."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if callable(obj):  # classes and functions pickle by their module's name
            self.modules.add(getattr(obj, "__module__", None))
        return NotImplemented


def _unpickle_with_plugins(files: list[str], data: bytes) -> Portable:
    for path in files:
        _import_file(Path(path))
    return Portable(pickle.loads(data))


def _same_source(registered: Any, target: Any) -> bool:
    """Whether `target` is `registered` imported again: the same plugin file read from another place (a copy in
    another run's directory), which registers its names once more — the newest is kept, as a re-import would."""
    import inspect

    if getattr(registered, "__qualname__", None) != getattr(target, "__qualname__", None):
        return False
    try:
        return inspect.getsource(registered) == inspect.getsource(target)
    except (OSError, TypeError):  # defined where no source can be read (an interactive session): not comparable
        return False
