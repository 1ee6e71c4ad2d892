"""torch, imported on first use: the modules that declare the pluggable pieces (algorithms, engines) are read by the
configuration (its schema, `--help`, its checks), which must answer without the seconds torch takes to import."""

import importlib
import types


class LazyModule(types.ModuleType):
    """A module imported when one of its attributes is first read."""

    def __getattr__(self, name: str):
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)  # later reads are plain attribute lookups
        return getattr(module, name)


torch = LazyModule("torch")
