"""The project's shape, counted: what a reader meets at the root, how deep the imports stack, and
the functions and modules too long to read in one sitting.

    python -m dev.layout            # the counts
    python -m dev.layout --chain    # ... and the longest import chain, floor by floor
    python -m dev.layout --root ../other/checkout   # another checkout's counts

Every import statement counts, at the top of a file or inside a function: a cycle through a
function-level import is still a cycle, only deferred to run time. A task file loaded by
episodes.task.import_file is composed at run time, not imported, and is no edge. A floor is a node
of the graph where each folder is one node (run/, infra/, ...) and each root module another; the
floors are the nodes on the longest chain of imports. tests/test_layout.py holds the rules.
"""

import argparse
import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("run", "infra", "scoring", "episodes", "perf", "data", "tasks", "dev")  # of modules
MAX_FUNCTION_LINES = 80  # def to last line, docstring in; tests/ and dev/ are not counted
MAX_MODULE_LINES = 700


def project_modules(root):
    """Module name -> file: the .py files at the root and in FOLDERS (a package's __init__.py is
    the package itself, e.g. "perf")."""
    modules = {}
    for folder in ("", *FOLDERS):
        if not os.path.isdir(os.path.join(root, folder)):
            continue
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


def import_graph(root=ROOT):
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
        graph[module] = found - {module}
    return graph


def node_of(module):
    """The floor node a module belongs to: its folder, or itself at the root."""
    return module.split(".")[0]


def folder_graph(graph):
    """The import graph with each folder one node: node -> the nodes it imports (not itself)."""
    nodes = {}
    for module, deps in graph.items():
        here = node_of(module)
        nodes.setdefault(here, set()).update(node_of(d) for d in deps if node_of(d) != here)
    return nodes


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


def longest_chain(graph):
    """The longest chain of imports [top, ..., bottom] in an acyclic graph."""
    @functools.cache
    def chain(node):
        below = [chain(dep) for dep in sorted(graph[node])]
        return (node, *max(below, key=len, default=()))

    return list(max((chain(node) for node in sorted(graph)), key=len, default=()))


def long_definitions(root=ROOT, limit=MAX_FUNCTION_LINES):
    """[(lines, "file:function")] of every function over `limit` lines, def to last line with its
    docstring (a method as Class.method), outside tests/ and dev/."""
    found = []
    for module, path in project_modules(root).items():
        if node_of(module) == "dev":
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    child.parent_class = node.name
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                name = ".".join(filter(None, [getattr(node, "parent_class", None), node.name]))
                if lines > limit:
                    found.append((lines, f"{os.path.relpath(path, root)}:{name}"))
    return sorted(found, reverse=True)


def long_modules(root=ROOT, limit=MAX_MODULE_LINES):
    """[(lines, file)] of every module over `limit` lines, outside tests/ and dev/."""
    found = []
    for module, path in project_modules(root).items():
        with open(path) as f:
            lines = sum(1 for _ in f)
        if node_of(module) != "dev" and lines > limit:
            found.append((lines, os.path.relpath(path, root)))
    return sorted(found, reverse=True)


def counts(root=ROOT):
    """The figures: root modules and their lines, floors and the longest chain, long code."""
    graph = import_graph(root)
    root_files = [m for m in graph if os.path.isfile(os.path.join(root, m + ".py"))]
    lines = 0
    for m in root_files:
        with open(os.path.join(root, m + ".py")) as f:
            lines += sum(1 for _ in f)
    nodes = folder_graph(graph)
    cycle = find_cycle(nodes)
    return {"root_modules": sorted(root_files), "root_lines": lines, "cycle": cycle,
            "chain": None if cycle else longest_chain(nodes),
            "module_chain": None if find_cycle(graph) else longest_chain(graph),
            "long_functions": long_definitions(root), "long_modules": long_modules(root)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chain", action="store_true", help="print the longest import chain")
    parser.add_argument("--root", default=ROOT, help="the project to count (default: this one)")
    args = parser.parse_args()
    c = counts(args.root)
    print(f"root modules      {len(c['root_modules'])} ({c['root_lines']:,} lines): "
          + " ".join(c["root_modules"]))
    if c["cycle"]:
        print("folder cycle      " + " -> ".join(c["cycle"]) + " (no floors with folders as one)")
    else:
        print(f"floors            {len(c['chain'])} (a folder counted as one)")
    if c["module_chain"]:
        print(f"module floors     {len(c['module_chain'])} (each module one)")
    if args.chain:
        for name, label in (("chain", "longest chain     "), ("module_chain", "... by module ")):
            if c[name]:
                print(label + " -> ".join(c[name]))
    print(f"functions > {MAX_FUNCTION_LINES}     {len(c['long_functions'])}"
          + "".join(f"\n    {n:4d}  {where}" for n, where in c["long_functions"]))
    print(f"modules > {MAX_MODULE_LINES}     {len(c['long_modules'])}"
          + "".join(f"\n    {n:4d}  {where}" for n, where in c["long_modules"]))


if __name__ == "__main__":
    main()
