"""The package's shape, as ARCHITECTURE.md draws it: layers without cycles.

Read from the source (every `import` and `from ... import`, lazy ones inside
functions included, since a lazy import is still a dependency):
- no import cycles among fastpersist's modules;
- each room imports only the rooms below it (ROOMS, MAY_IMPORT): the engine
  knows bytes, the format knows JSON, the daemon never imports torch-side code;
- no private name (`_x`) imported from another module;
- no module longer than MAX_LINES (generated stubs aside);
- integrations/ import only the public API and fastpersist.adapters, the
  adapters' contract, whose every name some adapter uses.
A new dependency that breaks these fails here, naming the import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fastpersist"
MAX_LINES = 400
GENERATED = ("fastpersist._proto",)
# Modules that exist but not as .py files here (the C engine, generated stubs).
NATIVE = {"fastpersist._engine", "fastpersist._codec", "fastpersist._format"}

# Each module's room: the longest prefix that names it.
ROOMS = {
    "fastpersist.errors": "base", "fastpersist.knobs": "base",
    "fastpersist._version": "base", "fastpersist._engine": "base",
    "fastpersist._proto": "base", "fastpersist.gcpause": "base",
    "fastpersist.anonmem": "base", "fastpersist.background": "base",
    "fastpersist.checksum": "base",
    "fastpersist.format": "format",
    "fastpersist._format": "format",  # the format's loops in C
    "fastpersist.codec": "codec", "fastpersist._codec": "codec",  # the codec's C core
    "fastpersist.engine": "engine",
    "fastpersist.storage": "storage",
    "fastpersist.protocol": "protocol",
    "fastpersist.tier": "tier",
    "fastpersist.tensors": "tensors",
    "fastpersist.saving": "saving",
    "fastpersist.distributed": "distributed",
    "fastpersist.loading": "loading",
    "fastpersist.files": "files",
    "fastpersist.daemon": "daemon",
    "fastpersist.api": "api", "fastpersist.checkpointer": "api", "fastpersist.resume": "api",
    "fastpersist.cadence": "api", "fastpersist.keep_best": "api",
    "fastpersist.checkpointer_base": "api",
    "fastpersist.store_checkpointer": "api",  # Checkpointer("s3://..."): saved to the store
    "fastpersist.adapters": "api",  # the adapters' contract (integrations/ import it)
    "fastpersist.cli": "cli",
    "fastpersist.integrations": "integrations",
    "fastpersist": "package",  # __init__: re-exports the API
}

_TORCH_FREE = {"base", "format", "engine", "storage", "protocol", "tier"}
# The codec (numpy and zstandard, no torch) is for the torch side, for the tier's
# compression on the way (tier/compress.py), and for the daemon's compression of
# what a client staged (Begin's compression): the daemon imports it only to compress.
_WITH_CODEC = _TORCH_FREE | {"codec"}
MAY_IMPORT: dict[str, set[str]] = {
    "base": {"base"},
    "format": {"base", "format"},
    "codec": {"base", "format", "codec"},
    "engine": {"base", "engine"},
    "storage": {"base", "format", "engine", "storage"},
    "protocol": {"base", "format", "storage", "protocol"},
    # The object-store tier: torch-free, so that the daemon uploads with it.
    "tier": {"base", "format", "codec", "engine", "storage", "tier"},
    "tensors": _WITH_CODEC | {"tensors"},
    "saving": _WITH_CODEC | {"tensors", "saving"},
    "distributed": _WITH_CODEC | {"tensors", "saving", "distributed"},
    # The one load, over any Source (tensors/source.py); distributed for resharding.
    "loading": _WITH_CODEC | {"tensors", "distributed", "loading"},
    # The daemon runs without torch and never plans or stages a save.
    "daemon": _WITH_CODEC | {"daemon"},
    # Single files (torch.save, one safetensors file, file objects) for api's save/load.
    "files": _WITH_CODEC | {"tensors", "files"},
    "api": _WITH_CODEC | {"tensors", "saving", "distributed", "loading", "files", "api"},
    # Adapters on the public API (the package's names, errors) and adapters.py, in
    # the api room: nothing below it (integration_imports_past_the_contract).
    "integrations": {"base", "api", "package", "integrations"},
    "cli": _WITH_CODEC | {"tensors", "saving", "distributed", "loading", "api", "cli"},
    "package": _WITH_CODEC | {"api", "package", "saving", "tensors", "distributed",
                              "loading"},
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (or whose name is imported)
    name: str | None  # `from target import name`
    line: int


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not name.startswith(GENERATED):
            out[name] = path
    return out


def room_of(module: str) -> str:
    best = max((p for p in ROOMS if module == p or module.startswith(p + ".")), key=len)
    return ROOMS[best]


def imports(mods: dict[str, Path]) -> Iterator[Import]:
    known = set(mods) | NATIVE | {m for m in ROOMS if m.startswith(GENERATED)}
    for source, path in mods.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "fastpersist":
                        yield Import(source, a.name, None, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "fastpersist":
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in known or any(k.startswith(sub + ".") for k in known):
                        yield Import(source, sub, None, node.lineno)  # a module
                    else:
                        yield Import(source, target, a.name, node.lineno)


def test_no_import_cycles() -> None:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for i in imports(mods):
        if i.target in mods and i.target != i.source:
            graph[i.source].add(i.target)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    assert not cycles, f"import cycles: {cycles}"


def test_rooms_import_only_the_rooms_below() -> None:
    mods = modules()
    wrong = []
    for i in imports(mods):
        src, dst = room_of(i.source), room_of(i.target)
        if dst not in MAY_IMPORT[src]:
            wrong.append(f"{i.source}:{i.line} ({src}) imports {i.target} ({dst})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_private_names_cross_modules() -> None:
    wrong = [f"{i.source}:{i.line} imports {i.name} from {i.target}"
             for i in imports(modules())
             if i.name and i.name.startswith("_") and not i.name.startswith("__")]
    assert not wrong, "private names imported from other modules:\n" + "\n".join(wrong)


def test_modules_stay_small() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_module_has_a_room() -> None:
    # A new top-level module must be placed (and so thought about) in ROOMS.
    loose = [m for m in modules() if room_of(m) == "package" and m != "fastpersist"]
    assert not loose, f"modules outside the rooms of ROOMS: {loose}"


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions and classes (at any depth), the
    attributes its code assigns on any object, and class-level assignments."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return own


def test_no_private_attributes_cross_modules() -> None:
    """Objects talk through public methods: no module reads or writes a
    private attribute (`obj._x`) that only another of fastpersist's modules
    defines. (Private names of other libraries, torch._C and the like, are
    theirs to keep stable, and not counted.)"""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules().items()}
    defined = {name: _own_names(tree) for name, tree in trees.items()}
    ours = set().union(*defined.values())
    wrong = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            if node.attr in defined[name] or node.attr not in ours:
                continue
            wrong.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
    assert not wrong, "private attributes used across modules:\n" + "\n".join(wrong)


def _reads_fastpersist_variable(node: ast.AST) -> bool:
    """os.environ.get("FASTPERSIST_..."), os.getenv(...), os.environ[...]."""
    if isinstance(node, ast.Call) and node.args:
        arg = node.args[0]
        called = ast.unparse(node.func)
        if called in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
            return isinstance(arg, ast.Constant) and str(arg.value).startswith("FASTPERSIST_")
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
        key = node.slice
        return isinstance(key, ast.Constant) and str(key.value).startswith("FASTPERSIST_")
    return False


def test_only_knobs_reads_the_environment() -> None:
    """Every FASTPERSIST_* variable is read in knobs.py, where the docs' table
    of them comes from: nowhere else decides a default or a parse."""
    wrong = []
    for name, path in modules().items():
        if name == "fastpersist.knobs":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _reads_fastpersist_variable(node):
                wrong.append(f"{name}:{node.lineno} reads {ast.unparse(node)}")
    assert not wrong, "FASTPERSIST_* read outside knobs.py:\n" + "\n".join(wrong)


# What integrations/ may import from fastpersist: the public API (the package's
# names, fastpersist.errors) and fastpersist.adapters, the adapters' contract: a
# small, named internal API whose every name some adapter needs. Beyond those,
# only EXCEPTIONS, each with its reason; a new internal import fails here until
# it goes into adapters.py (or its logic into the core) on purpose.
ADAPTER_API = {"fastpersist", "fastpersist.errors", "fastpersist.adapters"}
EXCEPTIONS: dict[str, set[tuple[str, str | None]]] = {}


def integration_imports_past_the_contract(mods: dict[str, Path]) -> list[str]:
    wrong = []
    for i in imports(mods):
        if not i.source.startswith("fastpersist.integrations") or i.target in ADAPTER_API \
                or i.target.startswith("fastpersist.integrations"):
            continue
        if (i.target, i.name) not in EXCEPTIONS.get(i.source, set()):
            wrong.append(f"{i.source}:{i.line} imports {i.name or '(module)'} from {i.target}")
    return wrong


def test_integrations_use_only_the_public_api_and_the_adapters_contract() -> None:
    wrong = integration_imports_past_the_contract(modules())
    assert not wrong, ("integrations reaching past fastpersist's public API and "
                       "fastpersist.adapters (add what an adapter needs to adapters.py, "
                       "or move the logic into the core):\n" + "\n".join(wrong))


def test_an_internal_import_in_an_integration_is_caught(tmp_path: Path) -> None:
    """The check above sees an internal import wherever an adapter puts it
    (at the top, or lazily inside a function), and lets the contract pass."""
    mods = modules()
    extra = tmp_path / "extra.py"
    mods["fastpersist.integrations.extra"] = extra

    def caught() -> list[str]:
        return [w.split(" imports ")[0] for w in integration_imports_past_the_contract(mods)
                if w.startswith("fastpersist.integrations.extra:")]

    for body in ("from ..saving.staging import StagingPool\n",
                 "def f() -> None:\n    from fastpersist.storage import commit\n"):
        extra.write_text(body)
        assert caught() == [f"fastpersist.integrations.extra:{body.count(chr(10))}"]
    extra.write_text("from ..adapters import StagingPool\nfrom ..errors import DaemonError\n"
                     "import fastpersist\n")
    assert caught() == []


def test_the_adapters_contract_holds_only_what_adapters_use() -> None:
    """Each name of fastpersist.adapters is a promise to every adapter: one
    that no integration uses is dropped, not kept "in case"."""
    tree = ast.parse((PACKAGE / "adapters.py").read_text())
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", "") == "__all__" for t in n.targets))
    used = {i.name for i in imports(modules())
            if i.source.startswith("fastpersist.integrations")
            and i.target == "fastpersist.adapters"}
    assert sorted(exported) == sorted(used), (
        f"unused: {sorted(set(exported) - used)}; used but not exported: "
        f"{sorted(used - set(exported))}")


def test_architecture_doc_matches_the_code() -> None:
    """ARCHITECTURE.md names only modules that exist (`x.py`, or a path that
    ends like one: `saving/pipeline.py`, `csrc/fp_util.c`), and every package
    of fastpersist (`saving/`, `dcp/`, ...)."""
    import re

    repo = PACKAGE.parent
    doc = (repo / "ARCHITECTURE.md").read_text()
    files = ["/" + str(p.relative_to(repo)) for p in repo.rglob("*")
             if p.suffix in (".py", ".c", ".h") and ".venv" not in p.parts]
    stale = [ref for ref in sorted(set(re.findall(r"`([\w./]+\.(?:py|c|h))`", doc)))
             if not any(f.endswith("/" + ref) for f in files)]
    assert not stale, f"ARCHITECTURE.md names modules that do not exist: {stale}"
    packages = sorted({p.parent.name for p in PACKAGE.rglob("__init__.py")
                       if p.parent != PACKAGE and "_proto" not in p.parts})
    unnamed = [p for p in packages if f"`{p}/`" not in doc and f"**`{p}/`**" not in doc]
    assert not unnamed, f"packages ARCHITECTURE.md does not describe: {unnamed}"
