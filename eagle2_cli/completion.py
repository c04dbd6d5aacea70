"""Shell completion scripts, as Click generates them (`_EAGLE2_COMPLETE=bash_source eagle2`).

`python -m eagle2_cli.completion` rewrites the copies in completions/; a test checks they match.
"""
from __future__ import annotations

import os
import sys

from click.shell_completion import get_completion_class

PROG = "eagle2"
COMPLETE_VAR = "_EAGLE2_COMPLETE"
FILES = {"bash": "eagle2.bash", "zsh": "_eagle2", "fish": "eagle2.fish"}


def completion_script(shell: str) -> str:
    from .main import cli

    cls = get_completion_class(shell)
    if cls is None:
        raise ValueError(f"no completion support for {shell!r}")
    return cls(cli, {}, PROG, COMPLETE_VAR).source()


def write_all(folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    written = []
    for shell, name in FILES.items():
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(completion_script(shell))
        written.append(path)
    return written


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "completions")
    for p in write_all(root):
        print(p)
