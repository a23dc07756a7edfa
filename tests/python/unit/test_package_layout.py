"""UT: the Python package's floors (docs/architecture.md). Every module of hypershard/ reads only
from its own floor or below, and no modules import each other in a circle. Read from the source
with ast (no import runs), so a new module or import that breaks the arrangement fails here."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "hypershard"

# Lowest first. A top-level folder of hypershard/ (or a module at its root) and its floor.
FLOORS = {
    "_C": 0,
    "tensor": 1,  # the DTensor core
    "parallel": 2,
    "fsdp": 2,
    "launch": 2,  # running ranks; reads only the mesh-axis names
    "compile": 3,
    "checkpoint": 3,
    "pipelining": 4,
    # the tools on top: they use the public API (the root package) and anything below
    "planner": 5,
    "sft": 5,
    "integrations": 5,
    "testing": 5,
    "tools": 5,
    "__init__": 5,  # the public names: import hypershard as hs
    "plan": 6,  # command entry points (python -m hypershard.plan / demo / coverage)
    "demo": 6,
    "coverage": 6,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor_of(module: str) -> int:
    parts = module.split(".")
    if parts[:2] == ["hypershard", "_C"]:
        return FLOORS["_C"]
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in FLOORS:
        raise AssertionError(f"{module}: hypershard/{top} has no floor in FLOORS; give it one (docs/architecture.md)")
    return FLOORS[top]


def _imports(path: Path) -> list:
    """(line, imported hypershard module) for every import in the file, at module level or inside a
    function alike (a lazy import still depends on what it imports)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "hypershard"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "hypershard":
                target = node.module
            else:
                continue
            # `from . import x` imports the module <target>.x where x is one (the extension _C too, built
            # outside the source folder);
            # otherwise it reads names of <target> itself
            names = []
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                where = PACKAGE.parent / Path(*candidate.split("."))
                is_module = where.with_suffix(".py").exists() or where.is_dir() or candidate == "hypershard._C"
                names.append(candidate if is_module else target)
        else:
            continue
        for name in names:
            found.append((node.lineno, name))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_import_reads_its_own_floor_or_below():
    upward = []
    for path in MODULES:
        module = _module_name(path)
        for line, target in _imports(path):
            if target == "hypershard" and _floor_of(module) < FLOORS["__init__"]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports the public package hypershard")
            elif target != "hypershard" and _floor_of(target) > _floor_of(module):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} (a higher floor)")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_circle_between_modules():
    graph: dict = {}
    for path in MODULES:
        module = _module_name(path)
        graph[module] = {t for _, t in _imports(path) if t != module and t.startswith("hypershard.")}

    # modules only: a package's __init__ importing its own submodules is how packages work
    def is_package(name: str) -> bool:
        return (PACKAGE.parent / Path(*name.split("."))).is_dir()

    edges = {m: {t for t in ts if t in graph and not is_package(t) and not is_package(m)} for m, ts in graph.items()}
    state: dict = {}
    cycles = []

    def visit(m: str, stack: list) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("planted", ["upward", "circle"])
def test_planted_faults_fail(tmp_path, monkeypatch, planted):
    """The two checks above fail on a planted upward import and a planted circle."""
    import shutil

    copy = tmp_path / "hypershard"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if planted == "upward":
        (copy / "tensor" / "planted.py").write_text("from ..parallel import parallelize\n")
        check = test_every_import_reads_its_own_floor_or_below
    else:
        (copy / "tensor" / "planted_a.py").write_text("from .planted_b import x\n")
        (copy / "tensor" / "planted_b.py").write_text("from .planted_a import y\n")
        check = test_no_import_circle_between_modules
    monkeypatch.setitem(globals(), "PACKAGE", copy)
    monkeypatch.setitem(globals(), "MODULES", sorted(copy.rglob("*.py")))
    with pytest.raises(AssertionError, match="planted"):
        check()
