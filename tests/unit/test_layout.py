"""Size limits of the code (issue 14): no module over 600 lines, no function over 60 lines unless
a comment says why.

The reason is a `# long: <reason>` comment right above the `def` (or above its first decorator;
the reason may go on over the comment lines that follow), or a line of the function's docstring
that starts with `long:`. Every Python file of
the packages is checked: ember/, operator/, sidecar/, benchmarks/ (not the one-off scripts kept as
data under benchmarks/results/), testing/ (tests are not).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("ember", "operator", "sidecar", "benchmarks", "testing")
SKIPPED_PARTS = {"__pycache__", ".venv", "build", ".work"}
DATA = ROOT / "benchmarks" / "results"  # one-off scripts kept as data beside the results they back
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
REASON = "# long:"


def python_files() -> list[Path]:
    files = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not SKIPPED_PARTS.intersection(path.relative_to(ROOT).parts) and DATA not in path.parents:
                files.append(path)
    return files


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the `def` to the last line of the body (decorators not counted)."""
    return (fn.end_lineno or fn.lineno) - fn.lineno + 1


def comment_block_above(lines: list[str], lineno: int) -> list[str]:
    """The comment lines right above 1-based line `lineno` (a reason may run over several lines)."""
    block = []
    n = lineno - 1
    while n >= 1 and lines[n - 1].strip().startswith("#"):
        block.append(lines[n - 1].strip())
        n -= 1
    return block


def has_reason(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    above = comment_block_above(lines, first) + comment_block_above(lines, fn.lineno)
    if any(line.startswith(REASON) and line[len(REASON):].strip() for line in above):
        return True
    doc = ast.get_docstring(fn) or ""
    return any(line.strip().startswith("long:") for line in doc.splitlines())


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def long_modules(files: list[Path]) -> list[str]:
    out = []
    for path in files:
        count = len(path.read_text().splitlines())
        if count > MAX_MODULE_LINES:
            out.append(f"{shown(path)}: {count} lines")
    return out


def long_functions(files: list[Path]) -> list[str]:
    out: list[tuple[str, int, str]] = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for fn in functions(ast.parse(text, filename=str(path))):
            n = function_lines(fn)
            if n > MAX_FUNCTION_LINES and not has_reason(fn, lines):
                out.append((shown(path), fn.lineno, f"{shown(path)}:{fn.lineno} {fn.name}: {n} lines"))
    return [line for _, _, line in sorted(out)]


def test_the_walk_sees_every_package() -> None:
    files = {str(p.relative_to(ROOT)) for p in python_files()}
    for expected in ("ember/cli/__init__.py", "operator/ember_operator/main.py",
                     "sidecar/ember_sidecar/main.py", "benchmarks/ember_bench/cli.py",
                     "testing/ember_testing/synthetic.py"):
        assert expected in files
    assert not [f for f in files if f.startswith("tests/")]


def test_no_module_over_600_lines() -> None:
    over = "\n".join(long_modules(python_files()))
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them along their seams):\n{over}"


def test_no_function_over_60_lines_without_a_reason() -> None:
    over = "\n".join(long_functions(python_files()))
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines with no `{REASON} <reason>` above the def:\n{over}"
    )


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = tmp_path / "m.py"
    src.write_text(
        f"def long_one():\n{body}\n\n\n"
        f"# long: a table, one row a line\n@staticmethod\ndef with_reason():\n{body}\n\n\n"
        f"# long: one run, read top to bottom:\n# the steps share state\ndef two_line_reason():\n{body}\n\n\n"
        f"# long:\ndef empty_reason():\n{body}\n\n\n"
        f"def with_doc_reason():\n    '''Does it.\n\n    long: one step a line\n    '''\n{body}\n\n\n"
        f"def short():\n    return 1\n"
    )
    found = long_functions([src])
    assert [line.split()[1] for line in found] == ["long_one:", "empty_reason:"]
    assert found[0].endswith(f"{MAX_FUNCTION_LINES + 1} lines")
    assert long_modules([src]) == []
    src.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules([src]) == [f"{src}: {MAX_MODULE_LINES + 1} lines"]
