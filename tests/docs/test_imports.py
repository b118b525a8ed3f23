"""The import structure of the packages: light commands start light, no import circles, layers point down, one path
per public name, and functions stay short. All checks read the source (ast) or run a fresh interpreter."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("balancer", "attention")
HEAVY = ("torch", "scipy", "pyarrow", "datasets", "transformers")
MAX_FUNCTION_LINES = 80


def _module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


MODULES = _module_files()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST) -> set[str]:
    """Every module name an import statement anywhere in `tree` names (function bodies included; `if
    TYPE_CHECKING:` blocks excluded, as they never run); `from a import b` names `a.b` when that is a module."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import at line {node.lineno}: imports are absolute"
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _internal(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of balancer/ and attention/ it imports (ast, every import statement)."""
    graph = {}
    for name, path in MODULES.items():
        targets = {_internal(n) for n in _imported_names(ast.parse(path.read_text(), str(path)))}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_sees_a_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_count():
    tree = ast.parse(
        "def f():\n    from balancer.planning.cost import model as cost\nif TYPE_CHECKING:\n    import balancer.cli\n"
    )
    assert _imported_names(tree) == {"balancer.planning.cost.model"}


# Every package and top-level module, by layer: a module imports only from lower layers or its own package. The
# sampler core (training) is below streams and measured balance, which are below the trainers and the framework
# integrations; the command line is on top. A new package must be placed here (test_every_package_has_a_layer).
LAYERS = {
    "attention": 0,
    "balancer.limits": 0,
    "balancer.paths": 0,
    "balancer.temporaries": 0,
    "balancer": 1,  # the root: lazy names only
    "balancer.strict_json": 1,
    "balancer.files": 1,
    "balancer.planning": 2,
    "balancer.data": 3,
    "balancer.distributed": 3,
    "balancer.calibration": 4,
    "balancer.training": 4,
    "balancer.streaming": 5,
    "balancer.measured": 6,
    "balancer.trainers": 7,
    "balancer.hf": 8,
    "balancer.integrations": 9,
    "balancer.cli": 10,
    "balancer.__main__": 11,
}


def layer_of(module: str) -> str:
    """The LAYERS key that owns `module` (the longest prefix)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise KeyError(module)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run upward (to a higher layer) or sideways (to another package of the same layer)."""
    wrong = []
    for module, targets in graph.items():
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs == mine or theirs == "balancer":
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{module} ({mine}, layer {LAYERS[mine]}) imports {target} (layer {LAYERS[theirs]})")
    return wrong


def test_every_package_has_a_layer():
    top = {".".join(m.split(".")[:2]) for m in MODULES if m.startswith("balancer")}
    assert sorted(top - set(LAYERS)) == [], "place every package of balancer/ and attention/ in LAYERS"


def test_layers_point_down():
    wrong = layering_violations(import_graph())
    assert not wrong, wrong


def test_layering_sees_an_upward_import():
    graph = {"balancer.training.sampler": {"balancer.trainers.trainer"}, "balancer.trainers.trainer": set()}
    assert layering_violations(graph) == [
        "balancer.training.sampler (balancer.training, layer 4) imports balancer.trainers.trainer (layer 7)"
    ]
    assert layering_violations({"balancer.calibration.run": {"balancer.training.loss"}})  # same layer, sideways


_NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy}:
            raise ImportError(f"{name} is absent in this test")
        return None

sys.meta_path.insert(0, NoTorch())
import numpy as np
import balancer
from balancer.planning.cost import explicit_layout, micro_batch_terms, predict_plan

lengths = np.random.default_rng(0).integers(50, 6000, size=400)
cost = balancer.CostModel(attn_coef=1e-9, linear_coef=1e-6, fixed=1e-4, piece_coef=1e-5, comm_coef=1e-9)
dynamic = balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=8192, cp_sizes=(1, 2, 4))
plan = balancer.plan(lengths, dynamic, cost, seed=0)
static = balancer.plan(lengths, balancer.Topology(dp=2, cp=2, micro_batches=2, max_tokens=8192), cost, seed=0)
report = predict_plan(static, cost, {"kind": "hybrid", "cost": cost.to_dict(), "method": "ring"})
spec = explicit_layout(lengths[:9], 4, {"kind": "hybrid", "cost": cost.to_dict()})
terms = micro_batch_terms(lengths[:9], 4, "hybrid", **{k: v for k, v in spec.items() if k != "kind"})
window = balancer.plan_window(lengths, dynamic, cost, seed=0, epoch=0, index=0, window_docs=200)
batch = balancer.balance_batch(lengths[:64], dynamic, cost, micro_batches="auto")
assert plan.metrics()["epoch_efficiency"] > 0 and report["step_time_total"] > 0
assert terms.tokens.sum() == lengths[:9].sum()
print(sorted(m for m in sys.modules if m.split(".")[0] in {heavy}))
"""


def test_planning_runs_without_torch(tmp_path):
    """`balancer.planning` (static, dynamic CP, windows, fixed batches, the cost-driven hybrid choice and the
    layout-aware prediction) runs in an interpreter where torch, scipy, pyarrow, datasets and transformers cannot be
    imported at all."""
    probe = _NO_TORCH.replace("{heavy}", repr(set(HEAVY)))
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---- light commands ----------------------------------------------------------------------------------------------

_PROBE = """
import contextlib, io, json, sys
argv = json.loads(sys.argv[1])
if argv is None:
    import balancer
else:
    from balancer.cli import main
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    assert code == 0, code
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy})))
"""


@pytest.fixture(scope="module")
def lengths_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lengths")
    lengths = np.random.default_rng(0).integers(100, 20_000, size=3000)
    np.save(folder / "lengths.npy", lengths)
    (folder / "lengths.json").write_text(json.dumps(lengths.tolist()))
    return folder


@pytest.mark.parametrize(
    "argv",
    [
        None,
        ["--help"],
        ["plan", "--help"],
        ["stats", "--help"],
        ["pack", "--help"],
        ["pretokenize", "--help"],
        ["stats", "LENGTHS/lengths.npy"],
        ["stats", "LENGTHS/lengths.json", "--dp", "4"],
        ["stats", "wlbllm"],
        ["stats", "wlbllm", "--no-plan"],
    ],
    ids=lambda a: "import balancer" if a is None else " ".join(a),
)
def test_light_commands_import_no_heavy_module(argv, lengths_files, tmp_path):
    """`import balancer`, the parsers and `stats` of a lengths file or built-in trace import none of torch, scipy,
    pyarrow, datasets or transformers (a fresh interpreter each)."""
    if argv is not None:
        argv = [a.replace("LENGTHS", str(lengths_files)) for a in argv]
    probe = _PROBE.replace("{heavy}", repr(set(HEAVY)))
    done = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(argv)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert heavy == [], f"{argv}: imported {sorted({m.split('.')[0] for m in heavy})}"


# ---- one path per name ---------------------------------------------------------------------------------------------


@functools.cache
def _defined_names(path: Path) -> set[str]:
    """Names a module defines at its top level (def, class, assignment), not the ones it imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _literal(module: str, variable: str):
    """The value of a top-level `variable = <literal>` of `module`, or None."""
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == variable for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:  # `[*_EXPORTS, ...]`
                return None
    return None


def _exports(package: str) -> dict[str, str]:
    """A package `__init__`'s lazy exports (name -> home module), read from its `_EXPORTS` literal."""
    return _literal(package, "_EXPORTS") or {}


def _package_names(package: str) -> set[str]:
    """What a package offers: its lazy exports, its `__all__` and what its `__init__` defines itself."""
    return set(_exports(package)) | set(_literal(package, "__all__") or ()) | _defined_names(MODULES[package])


def _python_sources():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in tracked.split():
        path = ROOT / rel
        if rel.endswith(".py") and path.exists():
            yield rel, path.read_text()
        elif rel.endswith(".md") and path.exists():
            for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
                yield rel, block


def test_one_path_per_name():
    """Every `from balancer... import NAME` / `from attention... import NAME` in the repository (code, tests,
    benchmarks, examples, docs snippets) names NAME's home module, a submodule, or a package that exports it."""
    wrong = []
    for rel, source in _python_sources():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES):
                continue
            if node.module not in MODULES:
                wrong.append(f"{rel}:{node.lineno}: no module {node.module}")
                continue
            is_package = MODULES[node.module].name == "__init__.py"
            allowed = _package_names(node.module) if is_package else _defined_names(MODULES[node.module])
            if node.module == "balancer":
                allowed.add("__version__")
            for alias in node.names:
                if alias.name not in allowed and f"{node.module}.{alias.name}" not in MODULES:
                    wrong.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name}")
    assert not wrong, "\n".join(wrong)


def test_every_export_lives_where_its_package_says():
    packages = [name for name, path in MODULES.items() if path.name == "__init__.py"]
    for package in packages:
        module = importlib.import_module(package)
        for name, home in _exports(package).items():
            assert name in module.__all__, f"{package}.{name} missing from __all__"
            if home.rsplit(".", 1)[-1] == name:  # a module exported by name
                assert home in MODULES
                continue
            assert name in _defined_names(MODULES[home]), f"{package}: {name} is not defined in {home}"


def test_no_export_shadows_a_submodule():
    """`balancer.data.pack` cannot be both the subpackage and the function: once the subpackage is imported Python
    sets the attribute to it. An export named like a submodule of its package must be that submodule."""
    clashes = []
    for package, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for name, home in _exports(package).items():
            child = f"{package}.{name}"
            if child in MODULES and home != child:
                clashes.append(f"{package} exports {name} from {home}, but {child} is a module")
    assert not clashes, clashes


def test_design_doc_lists_every_export():
    """docs/design.md's export table names every export of every package (`balancer...` lazy exports and
    `attention.__all__`) in its package's row."""
    rows = {}
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        match = re.match(r"\| `([\w.]+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    missing = []
    for package, path in MODULES.items():
        if path.name != "__init__.py" or package.startswith(("balancer.cli", "attention.")):
            continue
        names = list(_exports(package)) or list(_literal(package, "__all__") or [])
        missing += [f"{package}.{name}" for name in names if f"`{name}`" not in rows.get(package, "")]
    assert not missing, missing


# ---- short functions ---------------------------------------------------------------------------------------------


# Functions over the limit whose owner is splitting them (remove the entry when done; the test fails for any other).
KNOWN_LONG: set[str] = set()


def test_functions_are_short():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{path.relative_to(ROOT)}:{node.name}" not in KNOWN_LONG:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


# ---- modules by idea ----------------------------------------------------------------------------------------------
# Modules are split by idea, not by line count (there is no module length limit): each one opens with a docstring
# whose first line says what it holds, so a module whose docstring cannot name one idea shows it.


def _missing_idea(source: str) -> bool:
    doc = ast.get_docstring(ast.parse(source))
    return doc is None or not doc.strip()


def test_every_module_states_its_idea():
    missing = [str(p.relative_to(ROOT)) for p in MODULES.values() if _missing_idea(p.read_text())]
    assert not missing, f"modules without a docstring stating their idea: {missing}"


def test_missing_idea_sees_a_module_without_a_docstring():
    assert _missing_idea("import os\n")
    assert _missing_idea('"""   """\n')
    assert not _missing_idea('"""The window schedule: which model plans window w."""\n')


@pytest.mark.parametrize(
    "package,name,home",
    [
        ("balancer", "pack_step", "balancer.planning.packing"),
        ("balancer", "Span", "balancer.training"),
        ("balancer", "Member", "balancer.training"),
        ("balancer", "CPGroup", "balancer.training"),
        ("balancer.planning", "pack_step", "balancer.planning.packing"),
    ],
)
def test_a_removed_top_level_name_names_its_new_home(package, name, home):
    """Internals no longer exported at the top: the AttributeError says where they live now, and they do."""
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=f"use {home}.{name}"):
        getattr(module, name)
    assert getattr(importlib.import_module(home), name) is not None


def test_top_level_keeps_every_name_the_readme_and_contracts_use():
    """Every `balancer.<Name>` the README uses resolves at the top level."""
    import balancer

    used = set(re.findall(r"\bbalancer\.([A-Za-z_]\w*)", (ROOT / "README.md").read_text()))
    subpackages = {p.name for p in (ROOT / "balancer").iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    missing = [
        n for n in sorted(used) if n not in subpackages and f"{n}.py" not in subpackages and not hasattr(balancer, n)
    ]
    assert not missing, missing
