"""Every command (the scripts of training/ and benchmarks/) has the one shape: `main(argv: list[str] | None = None)
-> int` run by `raise SystemExit(main())`; no script imports another (they are thin over library modules); and no
module of the repository edits sys.path. Read from the source, nothing imported."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "benchmarks")
MODULE_PREFIX = {"training": "hf_linear_attn.training", "benchmarks": "benchmarks"}  # how each folder is imported


def is_script(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'" for node in tree.body)


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


SCRIPTS = sorted(path for package in PACKAGES for path in (ROOT / package).glob("*.py") if is_script(parsed(path)))


def test_the_commands_are_found():
    names = {f"{path.parent.name}/{path.stem}" for path in SCRIPTS}
    assert {"training/convert", "training/finetune", "training/long_context", "benchmarks/gpu_check",
            "benchmarks/bench_decode"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_command_has_the_one_exit_style_and_imports_no_other_script(path):
    tree = parsed(path)
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert [arg.arg for arg in main.args.args] == ["argv"]
    assert ast.unparse(main.args.args[0].annotation) == "list[str] | None"
    assert [ast.unparse(default) for default in main.args.defaults] == ["None"]
    assert ast.unparse(main.returns) == "int"
    last = tree.body[-1]
    assert ast.unparse(last) == "if __name__ == '__main__':\n    raise SystemExit(main())"
    scripts = {f"{MODULE_PREFIX[script.parent.name]}.{script.stem}" for script in SCRIPTS}
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    assert not imported & scripts, f"{path.name} imports the script(s) {sorted(imported & scripts)}"


def sys_path_edits(tree: ast.Module) -> list[int]:
    """Lines that change sys.path: a call of one of its methods, or an assignment to it or to a slice of it."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if ast.unparse(node.func.value) == "sys.path":
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(target).startswith("sys.path") for target in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_sys_path_edits_are_found():
    code = "import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\nprint([*sys.path])\n"
    assert sys_path_edits(ast.parse(code)) == [2, 3, 4]


def test_no_module_edits_sys_path():
    """Outside code reaches a process through a child's PYTHONPATH, importlib or an installed package, never by
    editing sys.path (docs/design.md, the benchmarks' module map)."""
    editing = [f"{path.relative_to(ROOT)}:{line}" for package in ("hf_linear_attn", *PACKAGES, "tests")
               for path in sorted((ROOT / package).rglob("*.py")) for line in sys_path_edits(parsed(path))]
    assert editing == []
