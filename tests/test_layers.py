"""The packages import each other one way only: contracts at the bottom, entry points at the top.

Read from the source with ``ast`` (every import, at module level or inside a function), so a
wrong-way import fails here even if no test happens to execute it.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: the model's sub-packages, bottom to top: each may import those before it
MODEL = ("hpipe.model.kernels", "hpipe.model.weights", "hpipe.model.kv", "hpipe.model.compute", "hpipe.model.generate")

#: package -> the packages it may import (besides itself and third-party libraries)
ALLOWED = {
    "hpipe.core": set(),
    "hpipe.model": set(),  # its __init__ only: the code lives in the sub-packages
    "hpipe.model.kernels": {"hpipe.core"},  # C++ kernels and their faces
    "hpipe.model.weights": {"hpipe.core"},  # formats, sources, manifests
    "hpipe.model.kv": {"hpipe.core"},  # the KV pool and caches
    "hpipe.model.compute": {"hpipe.core", *MODEL[:3]},  # units, linear layers, stages
    "hpipe.model.generate": {"hpipe.core", *MODEL[:4]},  # text in one process
    "planner": {"hpipe.core"},
    "runtime": set(),  # its __init__ only: the code lives in the four packages below
    "runtime.wire": {"hpipe.core"},
    # daemon and coordinator meet only on the wire: neither imports the other
    "runtime.daemon": {"hpipe.core", *MODEL, "runtime.wire"},
    "runtime.coordinator": {"hpipe.core", *MODEL, "runtime.wire"},
    "runtime.cluster": {"hpipe.core", "runtime.wire"},
    "profiler": {"hpipe.core", *MODEL, "runtime.wire", "runtime.daemon"},  # its service runs in a daemon
    "hpipe.app": {"hpipe.core", *MODEL, "planner", "profiler", "runtime.wire", "runtime.daemon",
                  "runtime.coordinator", "runtime.cluster"},
}
OURS = ("hpipe", "planner", "profiler", "runtime")
MAX_LINES = 400


def _package_of(module: str) -> str | None:
    for pkg in sorted(ALLOWED, key=len, reverse=True):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return None


def _modules():
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "proto_gen" in path.parts:
                continue
            yield path, ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_imports_point_one_way():
    wrong = []
    for path, module in _modules():
        pkg = _package_of(module)
        if pkg is None:  # hpipe/__init__.py, hpipe/__main__.py: the entry points' shims
            continue
        for imported in _imports(path):
            if not imported.startswith(OURS):
                continue
            target = _package_of(imported)
            if target is None:
                if imported.split(".")[0] == "hpipe" and imported != "hpipe":
                    wrong.append(f"{module} imports {imported}, which is in no layer")
                continue
            if target != pkg and target not in ALLOWED[pkg]:
                wrong.append(f"{module} ({pkg}) imports {imported} ({target})")
    assert not wrong, "\n".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """Each of our modules -> ours it imports (at module level or inside a function)."""
    names = {}
    for path, module in _modules():
        names[module.removesuffix(".__init__")] = path
    graph = {m: set() for m in names}
    for module, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            graph[module] |= {t for t in targets if t in names and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_circle_of_imports():
    """No module reaches itself through imports, even lazily inside a function: a circle means
    neither side can be understood, tested or moved alone (the model's layers, quant and
    cpu_kernel once made one; so did quantize and sources, cli and commands)."""
    circles = _circles(_module_graph())
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_in_a_layer_and_short():
    stray, long = [], []
    for path, _ in _modules():
        if not (path.parent / "__init__.py").exists():
            stray.append(f"{path.parent.relative_to(ROOT)} has no __init__.py (an installed wheel would miss it)")
    for path, module in _modules():
        if _package_of(module) is None and module not in ("hpipe", "hpipe.__init__", "hpipe.__main__"):
            stray.append(module)
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long.append(f"{module}: {lines} lines")
    assert not stray and not long, stray + long


@pytest.mark.parametrize("package", ["planner", "hpipe.core"])
def test_planner_and_contracts_load_no_heavy_library(package):
    modules = [m for _, m in _modules() if _package_of(m) == package]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print(sorted({'torch', 'grpc', 'matplotlib', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_object_reads_another_modules_private_state():
    """``obj._name`` only where ``obj`` is ``self``/``cls`` or the module defines ``_name`` itself (a
    classmethod finishing its own instance): a part of the daemon that needs something of another
    gets it as a collaborator's public method, not by reaching into it. Library privates reached
    through an imported module (``torch.ops.mkl._mkl_linear``, ``os._exit``) are not ours."""
    found = []
    for path, module in _modules():
        tree = ast.parse(path.read_text(), str(path))
        imported, own = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (isinstance(root, ast.Name) and root.id in imported) or node.attr in own:
                continue
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
