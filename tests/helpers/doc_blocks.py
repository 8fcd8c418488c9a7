"""Runs one page's code blocks in order, in this process: the runner of tests/test_docs.py.

    python doc_blocks.py BLOCKS.json DONE_FILE

BLOCKS.json is a list of {"lang", "code", "file", "where"}. ```python blocks are exec'd in
one namespace shared by the page's python blocks; ```bash blocks run with
`bash -euo pipefail`, and what they export carries to the page's later blocks (as
in one shell session). The index of each block that finished is appended to
DONE_FILE, so the test can tell which blocks ran. The first failure ends the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# A shell's own variables, which are not the page's exports.
_SHELL_VARIABLES = {"PWD", "OLDPWD", "SHLVL", "_"}


def run_bash(code: str) -> None:
    with tempfile.NamedTemporaryFile(prefix="fpdoc-env-", delete=False) as f:
        env_file = f.name
    try:
        script = f"set -euo pipefail\n{code}\nenv -0 > {env_file}\n"
        subprocess.run(["bash", "-c", script], check=True)
        exported = Path(env_file).read_bytes().split(b"\0")
    finally:
        os.unlink(env_file)
    for item in exported:
        name, sep, value = item.decode().partition("=")
        if sep and name not in _SHELL_VARIABLES and os.environ.get(name) != value:
            os.environ[name] = value


def main() -> None:
    blocks = json.loads(Path(sys.argv[1]).read_text())
    done = Path(sys.argv[2])
    namespace: dict[str, object] = {"__name__": "__main__"}
    for index, block in enumerate(blocks):
        print(f"--- block {index} ({block['where']}, {block['lang']})", flush=True)
        if block["lang"] == "python":
            exec(compile(block["code"], block["file"], "exec"), namespace)
        else:
            run_bash(block["code"])
        sys.stdout.flush()
        with done.open("a") as f:
            f.write(f"{index}\n")


if __name__ == "__main__":
    main()
