"""Size limits a newcomer can read by: no function over 80 lines and no module over 450 in
tailorfx/ (a Triton kernel template may exceed both, saying why in a `# length:` line near its
top). That no private name crosses a module is tests/test_layers.py's."""
import ast
import pathlib

import tailorfx

PACKAGE = pathlib.Path(tailorfx.__file__).parent
MAX_FILE, MAX_FUNCTION = 450, 80
TEMPLATES = "kernels/"   # where a kernel template may say why it is longer


def exempt(path: pathlib.Path, root: pathlib.Path, text: str) -> bool:
    rel = path.relative_to(root).as_posix()
    return rel.startswith(TEMPLATES) and any(line.startswith("# length: ") and len(line) > 30
                                             for line in text.splitlines()[:60])


def too_long(root: pathlib.Path) -> list[str]:
    """'path: N lines' and 'path:line name: N lines' past the limits, exempt templates aside."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if exempt(path, root, text):
            continue
        rel = path.relative_to(root.parent)
        if (n := len(text.splitlines())) > MAX_FILE:
            out.append(f"{rel}: {n} lines (at most {MAX_FILE})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                    out.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION})")
    return out


def test_no_long_function_or_module():
    assert too_long(PACKAGE) == []


def test_the_checker_names_what_it_finds(tmp_path):
    pkg = tmp_path / "tailorfx"
    (pkg / "kernels").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (pkg / "long.py").write_text(f"def f():\n{body}\n" + "\n" * 400)
    (pkg / "kernels" / "kernel.py").write_text("# length: one kernel template, rendered from shared pieces\n"
                                                          f"def f():\n{body}\n" + "\n" * 400)
    assert too_long(pkg) == ["tailorfx/long.py: 482 lines (at most 450)", "tailorfx/long.py:1 f: 82 lines (at most 80)"]
