"""Ship the op's C++/CUDA sources in the sdist and the wheel: from the checkout's top-level `csrc/` (the project's
layout), or from the copy an sdist carries (a wheel built from the sdist alone)."""

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

MARKER = "lora_merge_ops.cpp"


class OpSourcesHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        found = [path for path in (root / "csrc", root.parent.parent / "csrc") if (path / MARKER).is_file()]
        if not found:
            raise FileNotFoundError(f"the op's sources ({MARKER}) are neither in {root / 'csrc'} (an sdist) nor in "
                                    f"{root.parent.parent / 'csrc'} (a checkout)")  # fmt: skip
        where = "lorarl/lora_merge/csrc" if self.target_name == "wheel" else "csrc"
        build_data["force_include"][str(found[0])] = where
