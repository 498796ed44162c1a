"""One-way layers: each module imports only from its own layer or lower ones (DESIGN.md, Layers),
and only tailorfx/compat/ touches private torch names."""
import ast
import pathlib
import re

import tailorfx

# bottom to top; a module's layer is that of the longest matching prefix
LAYERS = (
    ("compat", "errors"),
    ("budget", "setup", "models", "progress"),
    ("kernels",),   # the Triton kernel templates and their launchers: a library the runtime's ops call
    ("runtime", "attention"),
    ("rewrite",),
    ("passes",),
    ("codegen",),
    ("planner", "plan_search", "options", "report"),
    ("backend",),
    ("parallel", "trainers"),
    ("api", "sizing", "configs", "demo", "cli", "cli_args", ""),   # "" is the package itself (tailorfx/__init__.py)
)
PRIVATE = re.compile(r"torch\._|(?<![A-Za-z0-9])_dynamo\b|_functorch|_inductor|_subclasses|_guards|\._schema|\._opname|"
                     r"torch\.utils\._|fx\.experimental")


def layer_of(module: str) -> int:
    """Layer index of `tailorfx.x.y`: that of the longest entry of LAYERS it starts with."""
    parts = module.split(".")[1:]
    for n in range(len(parts), -1, -1):
        prefix = ".".join(parts[:n])
        for i, names in enumerate(LAYERS):
            if prefix in names:
                return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")


def imports(path: pathlib.Path, module: str) -> set[str]:
    """Every tailorfx module `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "tailorfx":
            out |= {f"{node.module}.{a.name}" if node.module == "tailorfx" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "tailorfx"}
    return out - {module}


def layer_violations(root: pathlib.Path) -> list[str]:
    """'tailorfx/x.py imports tailorfx.y: layer A may not import layer B' for each edge upward."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        mine = layer_of(module)
        for target in sorted(imports(path, module)):
            theirs = layer_of(target)
            if theirs > mine:
                bad.append(f"{rel} imports {target}: layer {mine} ({'/'.join(LAYERS[mine]) or 'tailorfx'}) may "
                           f"not import layer {theirs} ({'/'.join(LAYERS[theirs]) or 'tailorfx'})")
    return bad


PACKAGE = pathlib.Path(tailorfx.__file__).parent


def test_imports_point_down_the_layers():
    assert layer_violations(PACKAGE) == []


def test_the_checker_names_an_upward_import(tmp_path):
    pkg = tmp_path / "tailorfx"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "planner.py").write_text("from tailorfx.runtime import ops\n")          # down: fine
    (pkg / "runtime" / "ops.py").write_text("def f():\n    from tailorfx.planner import search\n")   # up
    assert layer_violations(pkg) == [
        "tailorfx/runtime/ops.py imports tailorfx.planner: layer 3 (runtime/attention) may not import "
        "layer 7 (planner/plan_search/options/report)"]


def test_only_compat_touches_private_torch_names():
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
             for p in sorted(PACKAGE.rglob("*.py")) if p.parent != PACKAGE / "compat"
             for i, line in enumerate(p.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert found == []


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """The strongly connected components of the import graph with more than one module,
    function-local imports counted (a `from tailorfx.x import y` of a submodule is an edge to it)."""
    import networkx as nx
    paths = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}

    def known(name: str) -> str:
        while name not in paths and "." in name:
            name = name.rsplit(".", 1)[0]
        return name
    g = nx.DiGraph()
    for module, path in paths.items():
        g.add_node(module)
        for target in imports(path, module):
            t = known(target)
            if t != module and t != root.name:   # the package's __init__ re-exports: not an edge back
                g.add_edge(module, t)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_no_import_cycle():
    assert import_cycles(PACKAGE) == []


# tailorfx/parallel/: each module imports only the ones before it (the package's docstring says what each is)
PARALLEL_ORDER = ("spec", "shapes", "tp_plan", "sequence_plan", "stages", "plan", "shard", "recompute_order", "trace", "profile", "compose",
                  "memory", "fit", "devices", "steptime", "calibrate", "world", "apply", "entry")


def test_the_parallel_package_imports_one_way():
    root = PACKAGE / "parallel"
    assert sorted(p.stem for p in root.glob("*.py") if p.stem != "__init__") == sorted(PARALLEL_ORDER)
    bad = []
    for i, name in enumerate(PARALLEL_ORDER):
        for target in sorted(imports(root / f"{name}.py", f"tailorfx.parallel.{name}")):
            if target.split(".")[:2] == ["tailorfx", "parallel"]:
                theirs = target.split(".")[2] if target.count(".") >= 2 else "__init__"
                if theirs not in PARALLEL_ORDER[:i]:
                    bad.append(f"parallel/{name}.py imports {target}")
    assert bad == []


def private_names_imported(path: pathlib.Path) -> list[str]:
    """`from tailorfx.x import _y` and `x._y` on a tailorfx module `x` in `path`."""
    tree = ast.parse(path.read_text())
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tailorfx":
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"from {node.module} import {a.name}")
                modules.add(a.asname or a.name)     # a submodule or a name: an attribute of either counts
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "tailorfx"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    found = {str(p.relative_to(PACKAGE.parent)): names for p in sorted(PACKAGE.rglob("*.py"))
             if (names := private_names_imported(p))}
    assert found == {}


def test_the_private_name_finder_sees_imports_and_attributes(tmp_path):
    path = tmp_path / "peek.py"
    path.write_text("from tailorfx.long import _hidden, f\nfrom tailorfx import rewrite\nrewrite._pool\n")
    assert private_names_imported(path) == ["from tailorfx.long import _hidden", "rewrite._pool"]


def test_the_cycle_finder_sees_a_function_local_import(tmp_path):
    pkg = tmp_path / "tailorfx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tailorfx.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from tailorfx import a\n")
    assert import_cycles(pkg) == [["tailorfx.a", "tailorfx.b"]]
