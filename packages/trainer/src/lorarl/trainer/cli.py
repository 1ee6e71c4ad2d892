"""`uv run trainer`: the command-line entry point."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("lorarl trainer: not yet available (tracked in issue 5).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
