"""The tests use the benchmarks and the test support (`ember_testing`) through public names only
(issue 35): a helper a test needs is public where it lives, so renaming a private one never
breaks a test it did not know about."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHARED = ("ember_bench", "ember_testing")


def private_uses(tree: ast.AST) -> list[str]:
    """`from ember_bench.x import _y`, and `m._y` / setattr(m, "_y") on a module imported as
    `from ember_bench import m`."""
    modules: set[str] = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in SHARED:
            for alias in node.names:
                if alias.name.startswith("_"):
                    out.append(f"{node.module}.{alias.name}")
                if node.module in SHARED:
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            name, attr = node.value.id, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "setattr" and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
              and node.args[0].id in modules and isinstance(node.args[1], ast.Constant)):
            name, attr = node.args[0].id, str(node.args[1].value)
        else:
            continue
        if attr.startswith("_"):
            out.append(f"{name}.{attr}")
    return out


def test_the_check_sees_private_names() -> None:
    src = ("from ember_bench.cb import _x\nfrom ember_bench import graphs\n"
           "graphs._y\nmp.setattr(graphs, '_z', 1)\n")
    assert private_uses(ast.parse(src)) == ["ember_bench.cb._x", "graphs._y", "graphs._z"]


def test_tests_import_public_names_only() -> None:
    found = [f"{p.relative_to(TESTS)}: {use}" for p in sorted(TESTS.rglob("*.py"))
             for use in private_uses(ast.parse(p.read_text(), filename=str(p)))]
    assert not found, "tests use private names of the benchmarks or the test support:\n" + "\n".join(found)
