"""Full type hints on public functions: every public function and method (no leading underscore, at module level or
in a public class) of `balancer` and `attention` annotates each parameter (self/cls aside) and its return. Read from
the source (ast); mypy (tools/test.sh) checks that the hints hold."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("balancer", "attention")


def _is_static(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def unhinted_parts(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    """The parameters of `fn` without an annotation (a method's self/cls aside), and "return" when it has none."""
    a = fn.args
    params = a.posonlyargs + a.args
    if method and not _is_static(fn) and params:
        params = params[1:]
    params = params + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
    return [p.arg for p in params if p.annotation is None] + ([] if fn.returns else ["return"])


def public_functions(tree: ast.Module):
    """(qualified name, function node, is a method) of the module's public functions and public classes' methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node, False
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item, True


def unhinted() -> dict[str, list[str]]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, fn, method in public_functions(ast.parse(path.read_text(), str(path))):
                parts = unhinted_parts(fn, method)
                if parts:
                    found[f"{path.relative_to(ROOT)}:{name}"] = parts
    return found


def test_public_functions_are_fully_hinted():
    found = unhinted()
    assert not found, "public functions lacking type hints (name: unannotated parts):\n" + "\n".join(
        f"{k}: {', '.join(v)}" for k, v in sorted(found.items())
    )


def test_the_check_sees_missing_hints():
    tree = ast.parse(
        "def f(a, b: int) -> int: ...\n"
        "def g(*args: int, **kw) -> None: ...\n"
        "def h(x: int): ...\n"
        "def _private(x): ...\n"
        "class C:\n"
        "    def m(self, y) -> None: ...\n"
        "    @staticmethod\n"
        "    def s(z: int) -> int: ...\n"
        "    def ok(self) -> int: ...\n"
        "class _P:\n"
        "    def m(self, y): ...\n"
    )
    found = {name: unhinted_parts(fn, method) for name, fn, method in public_functions(tree)}
    assert found == {"f": ["a"], "g": ["kw"], "h": ["return"], "C.m": ["y"], "C.s": [], "C.ok": []}
