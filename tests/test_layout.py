"""The project's layers: no import cycle among its own modules; config.py imports none of them.

    pytest tests/test_layout.py

Every import statement counts, at the top of a file or inside a function: a cycle through a
function-level import is still a cycle, only deferred to run time. A task file loaded by
task.import_file is composed at run time, not imported, and is no edge.
"""

import ast
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("data", "perf", "dev", "tasks")  # besides the files at the root


def project_modules(root):
    """Module name -> file: the .py files at the root and in FOLDERS (a package's __init__.py is
    the package itself, e.g. "perf")."""
    modules = {}
    for folder in ("", *FOLDERS):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if not name.endswith(".py"):
                continue
            parts = [folder] if folder else []
            if name != "__init__.py":
                parts.append(name[:-3])
            modules[".".join(parts)] = os.path.join(root, folder, name)
    return modules


def imported_names(node, module):
    """The dotted names one import statement may load: `import a.b` loads a and a.b; `from a
    import b` loads a, and a.b if that is a module; a relative import resolves against `module`'s
    package."""
    if isinstance(node, ast.Import):
        names = []
        for alias in node.names:
            parts = alias.name.split(".")
            names += [".".join(parts[: i + 1]) for i in range(len(parts))]
        return names
    base = node.module or ""
    if node.level:  # from . import x, from ..a import b
        package = module.split(".")[: -node.level]
        base = ".".join(package + ([base] if base else []))
    parts = base.split(".") if base else []
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return names + [f"{base}.{alias.name}" if base else alias.name for alias in node.names]


def import_graph(root):
    """Module -> the set of project modules it imports, from every import statement in its file."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        found = set()
        for node in ast.walk(tree):  # top-level and nested alike
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(n for n in imported_names(node, module) if n in modules)
        graph[module] = found
    return graph


def find_cycle(graph):
    """One import cycle as [a, b, ..., a], or None: a depth-first search for an edge back to a
    module still on the search path."""
    state = {}  # module -> "open" while on the path, "done" after
    path = []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def check_no_cycle(graph):
    """Fail naming the cycle, if the graph has one."""
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph(ROOT)
    # the walk sees the project: top-level imports, function-level ones, modules in folders
    assert {"loss", "perf.shared_prompt", "checkpoint", "log", "prepare"} <= graph["grpo"]
    assert "tools" in graph["prepare"]
    assert "model_files" in graph["data.files"]  # imported inside a function
    assert {"config", "data.arith", "rewards"} <= graph["tasks.math"]
    assert not any(name.startswith("tasks") for name in graph["task"])  # import_file: run time
    check_no_cycle(graph)


def test_config_imports_no_project_module():
    imported = import_graph(ROOT)["config"]
    assert not imported, f"config.py imports {sorted(imported)}: it is the bottom layer"


def copy_project(tmp_path):
    """The project's module files (what import_graph reads) in a scratch folder."""
    for folder in ("", *FOLDERS):
        os.makedirs(tmp_path / folder, exist_ok=True)
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py"):
                shutil.copy(os.path.join(ROOT, folder, name), tmp_path / folder / name)
    return tmp_path


def plant(path, code):
    with open(path, "a") as f:
        f.write(code)


@pytest.mark.parametrize("file, code, cycle", [
    # a function-level import is enough: loss -> grpo -> loss
    ("loss.py", "\n\ndef planted():\n    import grpo\n", ["grpo", "loss", "grpo"]),
    # through a package's module, by a from-import of the module itself
    ("perf/cpu.py", "\nfrom perf import shared_prompt\n", None),
    # a relative import resolves against the package
    ("perf/logprobs.py", "\nfrom .shared_prompt import tail_runs\n", None),
])
def test_a_planted_cycle_is_found_and_named(tmp_path, file, code, cycle):
    root = copy_project(tmp_path)
    check_no_cycle(import_graph(root))  # the copy is the project: no cycle
    plant(root / file, code)
    graph = import_graph(root)
    found = find_cycle(graph)
    assert found is not None and found[0] == found[-1] and len(found) >= 3
    assert all(b in graph[a] for a, b in zip(found, found[1:]))  # each step a real import
    # through the planted import, from whichever module the search met the cycle first
    assert set(cycle) <= set(found) if cycle else file[:-3].replace("/", ".") in found
    with pytest.raises(AssertionError, match="import cycle: " + " -> ".join(found)):
        check_no_cycle(graph)


def test_a_project_import_in_config_is_found(tmp_path):
    root = copy_project(tmp_path)
    plant(root / "config.py", "\n\ndef planted(cfg):\n    from task import load_task\n")
    graph = import_graph(root)
    assert graph["config"] == {"task"}
    assert "config" in find_cycle(graph)  # task imports config: a cycle as well
