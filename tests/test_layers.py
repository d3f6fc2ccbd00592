"""The packages form one-way layers (docs/design.md §3): coordination/ (the protocol) imports none of
rollout/, train/, rl/; rollout/ imports no train/ or rl/; train/ imports no rl/; bench/ stands on all
four. Read from the source with ast: every import, function-local ones included, every module a
module starts with `-m` and every script of scripts/ it runs. Imports inside functions are allowed
only in the modules of LATE_IMPORTS, for the reason given there."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from coordination.phases import PHASES, PhaseId
from rl.jobs import KINDS

ROOT = Path(__file__).resolve().parent.parent
# Each package and the packages it may import or start.
ALLOWED = {
    "coordination": set(),
    "rollout": {"coordination"},
    "train": {"coordination", "rollout"},
    "rl": {"coordination", "rollout", "train"},
    "bench": {"coordination", "rollout", "train", "rl"},
}
# The benchmarks' commands under the names they had before they moved to bench/: each file is a
# docstring, one import from bench/ and the `__main__` call, nothing else.
ALIASES = {"coordination/bench.py", "rollout/bench.py", "train/bench.py"}
# The modules whose functions may import, and why. A late import elsewhere saves nothing: no cycle
# between packages needs one, and a library a module needs anyway belongs at its top.
LATE_IMPORTS = {
    "bench/levers.py": "torch and transformers only once it builds its model, so --help answers at once",
    "bench/rollout_speed.py": "torch only when the transformers engine is measured, so --help answers at once",
    "bench/train_steps.py": "bench.load_publish imports torch, which the other training benchmarks leave to "
                            "the processes they start",
    "coordination/exhaustion.py": "procgroup imports exhaustion: ChildFailed is looked up when a failure is classified",
    "coordination/progress.py": "rich's progress bar only for a terminal that shows one",
    "coordination/report.py": "matplotlib and rich only for the report command that draws or prints",
    "coordination/sinks.py": "TensorBoard (torch) and W&B only for a sink the config enables",
    "coordination/status.py": "rich only for the table and the live view; --json does without",
    "rl/driver.py": "pyarrow, transformers and rich only in the phases that need them, so dry runs and "
                    "--help answer at once",
    "rl/model_inputs.py": "transformers only when a model folder is checked",
    "rl/run_cli.py": "the CLI: the run config, the driver and their libraries load after the flags are checked",
    "rollout/engines/__init__.py": "only the chosen engine's libraries load (torch for transformers, httpx for vLLM)",
    "rollout/engines/transformers_engine.py": "torch, transformers, peft and safetensors when the engine starts: "
                                              "the rollout worker and make_engine import the class without them",
    "rollout/judge/engine.py": "transformers for a vLLM judge's tokenizer only: the driver imports this module, and "
                               "dry runs and URL judges never load it",
    "train/batches.py": "torch only where tensors are built: the driver prepares batches without torch",
    "train/benchmark.py": "rl/run_cli imports it for its options: torch, numpy, rich and the torch-side train "
                          "modules load when a benchmark runs",
    "train/context.py": "transformers (about 1 s beyond torch; train.model imports this module) only when "
                        "train.cp > 1 registers its attention",
    "train/export.py": "transformers (the tokenizer copy) and torch.distributed.fsdp only on the paths that use them",
    "train/lora.py": "peft, safetensors and transformers only when LoRA is configured",
    "rollout/envs/__init__.py": "its call pool (calls.py) imports pyarrow through rollout.chunks; run.sh's input "
                                "rules import this module on every start, with or without tasks.env",
    "train/trainer_memory.py": "train.chunked_head imports torch; the memory plan runs in the CLI before torch loads",
    "train/model.py": "transformers (about 1 s beyond torch) only where a model is loaded",
    "train/offload.py": "torch.distributed.tensor (about 1.4 s beyond torch) only when FSDP shards the model",
    "train/optim.py": "torch only when an optimizer is built: the run config reads the schedule without it",
    "train/optim_state.py": "torch.distributed.checkpoint only when optimizer state is written or read",
    "train/parallel.py": "torch.distributed's fsdp, tensor and checkpoint modules only for the backend in use",
    "train/sft.py": "the CLI: torch, transformers, numpy and the torch-side train modules after the flags are checked",
    "train/sharded.py": "transformers, safetensors and torch.distributed's tensor and checkpoint modules only "
                        "on the path that reads or writes shards",
    "train/tiny.py": "tokenizers, torch and transformers only when a model is written",
    "train/trainer.py": "the torchrun entry: torch and pyarrow only inside the functions that train, so "
                        "--help and usage errors answer at once",
}
SCRIPTS = ROOT / "scripts"


def sources() -> list[Path]:
    return sorted(p for package in ALLOWED for p in (ROOT / package).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or ""] if node.level == 0 else []


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module loads: at its top, or under a top-level if/try."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            found += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
    return found


def late_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    top = set(map(id, top_level_imports(tree)))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top]


def started_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every `-m MODULE` in a list or tuple and every `module="..."` keyword (the
    torchrun command's target)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for a, b in zip(node.elts, node.elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant):
                    found.append((b.lineno, b.value))
        elif isinstance(node, ast.keyword) and node.arg == "module" and isinstance(node.value, ast.Constant):
            found.append((node.value.lineno, node.value.value))
    return found


def started_scripts(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every string that is exactly a script's name or its path under scripts/."""
    names = {p.name for p in SCRIPTS.iterdir()}
    return [(n.lineno, n.value.rsplit("/", 1)[-1]) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and (n.value in names or (n.value.startswith("scripts/") and n.value[8:] in names))]


def script_packages(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The packages whose modules a script runs with `-m`, directly or through another script."""
    text = (SCRIPTS / name).read_text()
    found = {m.split(".")[0] for m in re.findall(r"-m\s+([\w.]+)", text)} & set(ALLOWED)
    for other in set(re.findall(r"scripts/([\w.-]+\.sh)", text)) - seen - {name}:
        if (SCRIPTS / other).exists():
            found |= script_packages(other, seen | {name})
    return found


def test_every_package_imports_only_the_layers_below_it():
    wrong = []
    for path in sources():
        package = rel(path).split("/")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for module in imported(node):
                top = module.split(".")[0]
                if top in ALLOWED and top != package and top not in ALLOWED[package] \
                        and not (rel(path) in ALIASES and top == "bench"):
                    wrong.append(f"{rel(path)}:{node.lineno} imports {module}")
    assert not wrong, wrong


def test_an_alias_of_a_benchmark_holds_only_the_call_into_bench():
    for name in ALIASES:
        tree = ast.parse((ROOT / name).read_text())
        kinds = [type(n).__name__ for n in tree.body]
        assert kinds == ["Expr", "ImportFrom", "If"], (name, kinds)
        assert tree.body[1].module.startswith("bench."), name


def test_every_module_starts_only_modules_and_scripts_of_its_layer_or_below():
    wrong, seen = [], set()
    for path in sources():
        package = rel(path).split("/")[0]
        tree = ast.parse(path.read_text(), str(path))
        for line, module in started_modules(tree):
            seen.add((rel(path), module))
            top = module.split(".")[0]
            if top in ALLOWED and top != package and top not in ALLOWED[package]:
                wrong.append(f"{rel(path)}:{line} starts -m {module}")
        for line, script in started_scripts(tree):
            seen.add((rel(path), script))
            above = script_packages(script) - ALLOWED[package] - {package}
            if above:
                wrong.append(f"{rel(path)}:{line} runs scripts/{script}, which runs {sorted(above)}")
    assert not wrong, wrong
    # The reading finds what the code starts: the driver's trainer, the benchmarks' runs and ranks.
    assert {("rl/plan.py", "train.trainer"), ("bench/iteration.py", "run.sh"), ("bench/levers.py", "train.trainer"),
            ("bench/load_publish.py", "bench.load_publish"), ("bench/protocol.py", "bench.protocol")} <= seen
    assert script_packages("run.sh") == {"rl"} and "rl" in script_packages("demo.sh")


def test_imports_inside_functions_only_in_the_modules_that_say_why():
    late = {rel(p) for p in sources() if late_imports(ast.parse(p.read_text()))}
    assert sorted(late - set(LATE_IMPORTS)) == [], "import at the top, or add the module and its reason"
    assert sorted(set(LATE_IMPORTS) - late) == [], "these modules import nothing late any more: drop them"


def test_no_function_imports_again_from_a_module_the_top_imports():
    again = []
    for path in sources():
        tree = ast.parse(path.read_text())
        at_top = {m for n in top_level_imports(tree) for m in imported(n)}
        again += [f"{rel(path)}:{n.lineno} {m}" for n in late_imports(tree) for m in imported(n) if m in at_top]
    assert not again, again


def test_a_module_that_imports_torch_at_its_top_imports_the_project_there_too():
    """Its late imports of project modules would save nothing: torch is the cost."""
    late = []
    for path in sources():
        tree = ast.parse(path.read_text())
        if "torch" in {m.split(".")[0] for n in top_level_imports(tree) for m in imported(n)}:
            late += [f"{rel(path)}:{n.lineno} {m}" for n in late_imports(tree) for m in imported(n)
                     if m.split(".")[0] in ALLOWED]
    assert not late, late


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
