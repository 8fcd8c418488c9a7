"""The C engine's files call each other in one direction only.

Which file calls which is read from the sources: the non-static `fp_*` functions each
`csrc/*.c` file defines, and the `fp_*` names each file uses. A use of a function that
another file defines is an edge between the two files. The check fails on a cycle, on
an edge that does not go down the layers below, and on a file not placed in a layer.

Run it on another tree with `python tests/test_c_layout.py PATH/TO/csrc`.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"

# Lowest first. A file may use functions defined in a lower layer only: never in its
# own layer (the two jobs, the two backends, the two entry points are independent)
# and never in a higher one. fp_internal.h states the same order.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("checksum", ("fp_crc32c.c",)),
    ("shared", ("fp_util.c", "fp_fault.c", "fp_piece.c", "fp_ring.c")),
    ("jobs", ("fp_write_job.c", "fp_read_job.c")),
    ("backends", ("fp_pool.c", "fp_uring.c")),
    ("entry points", ("fp_write.c", "fp_read.c", "fp_dir.c", "fp_gather.c")),
    ("binding", ("fp_module.c",)),
]
LAYER_OF = {name: rank for rank, (_, files) in enumerate(LAYERS) for name in files}

# Comments, string and character literals: names inside them are not uses.
_NOISE = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
# A function definition starts a line (the house style), is not static, and its
# parameter list is followed by the body.
_DEFINITION = re.compile(
    r"^(?!static\b)(?:[A-Za-z_][\w \t*]*?\b)?(fp_\w+)\s*\([^;{}]*\)\s*\{", re.M
)
# A prototype in a header: the same, ending with `;` (an attribute may come first).
_PROTOTYPE = re.compile(
    r"^(?!static\b)(?:[A-Za-z_][\w \t*]*?\b)?(fp_\w+)\s*\([^;{}]*\)"
    r"\s*(?:__attribute__\(\(.*?\)\)\s*)?;",
    re.M,
)
_NAME = re.compile(r"\bfp_\w+\b")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _code(path: Path) -> str:
    return _NOISE.sub(" ", path.read_text())


def definitions(csrc: Path) -> dict[str, str]:
    """Function name -> the .c file that defines it."""
    owner: dict[str, str] = {}
    for path in sorted(csrc.glob("*.c")):
        for name in _DEFINITION.findall(_code(path)):
            assert owner.setdefault(name, path.name) == path.name, (
                f"{name} is defined in both {owner[name]} and {path.name}"
            )
    return owner


def call_graph(csrc: Path) -> dict[str, set[str]]:
    """File -> the other files whose functions it uses."""
    owner = definitions(csrc)
    graph: dict[str, set[str]] = {}
    for path in sorted(csrc.glob("*.c")):
        used = {owner[n] for n in _NAME.findall(_code(path)) if n in owner}
        graph[path.name] = used - {path.name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of files (first file repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def violations(csrc: Path) -> list[str]:
    """Everything wrong with the layering of the tree at csrc, as sentences."""
    graph = call_graph(csrc)
    problems = [f"{f} is not placed in a layer (LAYERS)" for f in graph if f not in LAYER_OF]
    cycle = find_cycle(graph)
    if cycle:
        problems.append("cycle: " + " -> ".join(cycle))
    for src, dsts in sorted(graph.items()):
        for dst in sorted(dsts):
            if src in LAYER_OF and dst in LAYER_OF and LAYER_OF[dst] >= LAYER_OF[src]:
                problems.append(
                    f"{src} ({LAYERS[LAYER_OF[src]][0]}) uses {dst} "
                    f"({LAYERS[LAYER_OF[dst]][0]}): not a lower layer"
                )
    return problems


def test_the_engine_files_are_layered_without_cycles() -> None:
    problems = violations(CSRC)
    assert not problems, "\n".join(problems)


def test_every_layer_file_exists() -> None:
    assert sorted(p.name for p in CSRC.glob("*.c")) == sorted(LAYER_OF)


def test_the_parser_finds_every_declared_function() -> None:
    # Guards the check itself: a definition the pattern missed would hide its edges.
    declared = {n for h in ("fp_engine.h", "fp_internal.h") for n in
                _PROTOTYPE.findall(_code(CSRC / h))}
    assert len(declared) > 30
    assert declared - set(definitions(CSRC)) == set()


def test_files_share_only_the_two_headers() -> None:
    for path in CSRC.glob("*.c"):
        assert set(_INCLUDE.findall(path.read_text())) <= {"fp_engine.h", "fp_internal.h"}, path


def test_the_check_catches_an_upward_call_and_its_cycle(tmp_path: Path) -> None:
    # The shape of the old layout: job logic reaching into a backend that calls it.
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree)
    with (tree / "fp_write_job.c").open("a") as f:
        f.write("\nvoid fp_reaches_up(void)\n{\n    fp_uring_write(0, 0, 0, 0);\n}\n")
    found = violations(tree)
    assert any(p.startswith("cycle: ") and "fp_uring.c" in p for p in found), found
    assert "fp_write_job.c (jobs) uses fp_uring.c (backends): not a lower layer" in found


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else CSRC
    for file, uses in sorted(call_graph(target).items()):
        print(f"{file} -> {', '.join(sorted(uses)) or '-'}")
    found = violations(target)
    print("\n".join(found) or "layered, no cycles")
    sys.exit(1 if found else 0)
