"""The package stays readable: no function or method longer than 80 lines, no class longer than
400, no module longer than 600 (in the library and in the command's package)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "python"
LIMITS = {"function": 80, "class": 400, "module": 600}


def too_long(source: str, name: str) -> list[str]:
    """What in ``source`` is over its limit, as 'name:line what (lines)'."""
    out = []
    lines = len(source.splitlines())
    if lines > LIMITS["module"]:
        out.append(f"{name}: module ({lines} lines)")
    for node in ast.walk(ast.parse(source)):
        kind = ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                "class" if isinstance(node, ast.ClassDef) else None)
        if kind is not None:
            n = node.end_lineno - node.lineno + 1
            if n > LIMITS[kind]:
                out.append(f"{name}:{node.lineno} {kind} {node.name} ({n} lines)")
    return out


def test_the_checker_finds_what_is_too_long():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert too_long(f"def f():\n{body}\n", "long.py") == ["long.py:1 function f (81 lines)"]
    assert too_long(f"def f():\n{body[:-len('    x79 = 79') - 1]}\n", "ok.py") == []
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(134))
    assert too_long(f"class C:\n{methods}", "c.py") == ["c.py:1 class C (402 lines)"]
    assert too_long("x = 1\n" * 601, "m.py") == ["m.py: module (601 lines)"]


@pytest.mark.parametrize("package", ["pimhbm", "pimhbm_cli"])
def test_no_function_class_or_module_is_too_long(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) > 5
    found = [msg for f in files for msg in too_long(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []
