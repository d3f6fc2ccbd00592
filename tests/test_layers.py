"""The packages form one-way layers (docs/design.md §3): coordination/ (the protocol) imports none of
rollout/, train/, rl/; rollout/ imports no train/ or rl/; train/ imports no rl/. Read from the
source with ast, every import counted, function-local ones included."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from coordination.phases import PHASES, PhaseId
from rl.jobs import KINDS

ROOT = Path(__file__).resolve().parent.parent
# Each package and the packages it may import.
ALLOWED = {
    "coordination": set(),
    "rollout": {"coordination"},
    "train": {"coordination", "rollout"},
    "rl": {"coordination", "rollout", "train"},
}


def imports_of(package: str) -> dict[str, list[str]]:
    """Other top-level package -> 'file:line module' of each import of it inside `package`."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in ALLOWED and top != package:
                    found.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{node.lineno} {module}")
    return found


def test_every_package_imports_only_the_layers_below_it():
    wrong = {f"{package} -> {other}": where for package in ALLOWED
             for other, where in imports_of(package).items() if other not in ALLOWED[package]}
    assert not wrong, wrong


def test_phase_ids_name_the_phase_table():
    assert [(p.number, p.name) for p in PHASES] == [(int(i), i.name.lower().replace("_", "-")) for i in PhaseId]


def test_every_job_kind_runs_phases_of_the_table_in_order():
    for kind in KINDS.values():
        assert list(kind.phases) == sorted(set(kind.phases)), kind.name
        assert set(kind.phases) <= {p.number for p in PHASES}, kind.name


def test_only_the_cli_imports_the_driver_at_run_time():
    """The driver stands on every other module of rl/ and is entered only from the CLI, so nothing
    it imports can import it back (imports for type checks alone never run)."""
    importers = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [f"{node.module}.{a.name}" if node.module == "rl" else node.module or "" for a in node.names]
            else:
                continue
            if any(m == "rl.driver" or m.startswith("rl.driver.") for m in modules):
                importers.append(str(rel))
    assert importers == ["rl/run_cli.py"], importers


def _strings(node: ast.AST) -> set[str]:
    """The string constants of `node`, itself or the items of a tuple, list or set display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for item in node.elts for s in _strings(item)}
    return set()


def _names_a_split(node: ast.AST) -> bool:
    """`split` or `x.split`: the rollout split "eval" shares its word with the eval job."""
    return (isinstance(node, ast.Name) and node.id == "split") or (isinstance(node, ast.Attribute)
                                                                    and node.attr == "split")


def job_switches() -> list[str]:
    """'file:line source' of each comparison outside rl/jobs.py that decides by a job's name (`== "both"`,
    `in ("rollout", "eval")`) or by whether the benchmark's options are there (`args.bench is None`)."""
    found = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "rl" / "jobs.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Compare):
                    continue
                operands = [node.left, *node.comparators]
                by_name = (any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
                           and any(_strings(o) & set(KINDS) for o in operands)
                           and not any(_names_a_split(o) for o in operands))
                by_bench = (isinstance(node.left, ast.Attribute) and node.left.attr == "bench"
                            and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops))
                if by_name or by_bench:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_the_job_kinds_table_switches_on_a_job():
    # What a job does is a field of its JobKind (rl/jobs.py); a name compared elsewhere is a second
    # copy of that table that a new job kind would silently miss.
    assert job_switches() == []


def test_job_switch_check_sees_each_form_of_comparison(tmp_path, monkeypatch):
    # The check above finds nothing in the code; this proves it would find each form it looks for.
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "bad.py").write_text(
        'a = job == "both"\nb = "update" != kind\nc = name in ("rollout", "x")\nd = args.bench is None\n'
        'e = split == "eval"\nf = job == "train"\n')
    for package in ("coordination", "rollout", "train"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = Path("rl", "bad.py")
    assert [line.split(" ", 1)[0] for line in job_switches()] == [f"{bad}:{n}" for n in (1, 2, 3, 4)]
