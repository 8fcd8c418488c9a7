"""Every code block in README.md and docs/ runs, and the docs site builds.

Each page (README.md, docs/**/*.md) is one test. Its ```python and ```bash (or
```console, whose `$ ` lines are the commands) blocks run in document order in
one fresh process (tests/helpers/doc_blocks.py), in a temporary directory, with
PYTHONPATH set to this tree and this interpreter's bin/ first on PATH (so `python`,
`fpctl` and `fastpersistd` are this environment's). Python blocks share one
namespace, and what a bash block exports carries to the later blocks, so a
page's blocks may use what its earlier blocks made: a model, a checkpoint for
`fpctl`, a daemon started with `fastpersistd ... &` and `FASTPERSIST_DAEMON`.
The page's process group is killed at the end, so a daemon a page started does
not outlive it.

A block right after an HTML comment `<!-- not run: REASON -->` is skipped; every
other block must run, which the test checks from the runner's record of the
blocks it finished. Pages that name `s3://my-bucket` get a real S3 server
(moto's, tests/tier_support.py) with that bucket, and AWS_* pointing at it; pages
that call `init_process_group` get torchrun's environment for one process.

test_the_site_builds runs `mkdocs build --strict`: any warning (a broken link or
anchor, a page missing from the nav, a docstring mkdocstrings cannot render) fails it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tier_support

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).parent / "helpers" / "doc_blocks.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGS = {"python", "bash", "console"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->", re.S)
FENCE = re.compile(r"^```(\S*)\s*$")
# Pages that take more than a few seconds (frameworks, daemons, an S3 server).
SLOW = {"README.md", "docs/guides/frameworks.md", "docs/guides/dcp.md",
        "docs/guides/daemon.md", "docs/guides/tier.md", "docs/guides/distributed.md",
        "docs/guides/training-loop.md", "docs/guides/compression.md",
        "docs/guides/partial-reads.md", "docs/reference/api.md",
        "docs/reference/fpctl.md"}


@dataclass
class Block:
    lang: str
    code: str
    line: int
    not_run: str | None  # the reason, if marked


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, with the `not run` mark right before each (if any)."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        before = "\n".join(lines[:start]).rstrip()
        mark = NOT_RUN.search(before[-400:]) if before.endswith("-->") else None
        out.append(Block(m.group(1), "\n".join(lines[start + 1:j]) + "\n", start + 1,
                         mark.group(1) if mark else None))
        i = j + 1
    return out


def runnable(block: Block) -> str:
    if block.lang == "console":
        return "".join(line[2:] + "\n" for line in block.code.splitlines()
                       if line.startswith("$ "))
    return block.code


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_pages_have_blocks_and_marks_have_reasons() -> None:
    counted = {page_id(p): blocks(p) for p in PAGES}
    assert counted["README.md"], "README.md has no code blocks"
    run = [b for bs in counted.values() for b in bs if b.lang in RUN_LANGS and not b.not_run]
    assert len(run) >= 20, f"only {len(run)} blocks run: is the fence parser broken?"
    for name, bs in counted.items():
        for b in bs:
            if b.not_run is not None:
                assert len(b.not_run) > 10, f"{name}:{b.line}: say why it is not run"
                assert b.lang in RUN_LANGS, f"{name}:{b.line}: a mark on a block never run"
            if b.lang not in RUN_LANGS:
                # Plain blocks are diagrams and usage text: nothing in them is a command.
                assert b.lang in ("", "text"), f"{name}:{b.line}: unknown language {b.lang!r}"


@contextlib.contextmanager
def page_environment(text: str, workdir: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HOME": str(workdir / "home"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("FASTPERSIST_DAEMON", None)
    (workdir / "home").mkdir()
    if "init_process_group" in text:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(tier_support.free_port()))
    server = None
    if "s3://my-bucket" in text:
        server = tier_support.MotoServer(workdir).start()
        tier_support.make_bucket(server.endpoint, "my-bucket")
        env.update(tier_support.environment(server.endpoint, workdir / "home"))
    try:
        yield env
    finally:
        if server is not None:
            server.kill()


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the page's process group (a daemon it left), then SIGKILL what stays."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.mark.parametrize("page", [
    pytest.param(p, id=page_id(p), marks=[pytest.mark.slow] if page_id(p) in SLOW else [])
    for p in PAGES if any(b.lang in RUN_LANGS and b.not_run is None for b in blocks(p))])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    all_blocks = blocks(page)
    to_run = [b for b in all_blocks if b.lang in RUN_LANGS and b.not_run is None]
    name = page_id(page)
    workdir = tmp_path / "work"
    workdir.mkdir()
    spec = tmp_path / "blocks.json"
    # Blank lines first, so that a traceback's line numbers are the page's.
    spec.write_text(json.dumps([{"lang": b.lang, "code": "\n" * b.line + runnable(b),
                                 "file": name, "where": f"{name}:{b.line}"} for b in to_run]))
    done = tmp_path / "done"
    log_path = tmp_path / "page.log"
    with page_environment(page.read_text(), tmp_path) as env, open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(RUNNER), str(spec), str(done)],
                                cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            stop_group(proc)
            proc.wait()
    ran = [int(x) for x in done.read_text().split()] if done.exists() else []
    output = log_path.read_text(errors="replace")[-6000:]
    assert rc == 0 and ran == list(range(len(to_run))), (
        f"{name}: {len(ran)} of {len(to_run)} blocks ran; the first that did not: "
        f"{to_run[len(ran)].line if len(ran) < len(to_run) else '-'}\n{output}")


@pytest.mark.slow
def test_the_site_builds(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is not installed: it is in the test extra (pip install -e '.[test]')")
    proc = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    assert (tmp_path / "site" / "guides" / "daemon" / "index.html").exists()
    # The docstrings page is generated from the code (mkdocstrings), not left empty.
    generated = (tmp_path / "site" / "reference" / "docstrings" / "index.html").read_text()
    assert "as a checkpoint directory at" in generated
