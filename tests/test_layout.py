"""The project's shape: the root holds the design card, imports run one way, no import cycle.

    pytest tests/test_layout.py          (python -m dev.layout prints the counts)

The root is GRPO alone, in run order; each folder has a role, and its imports run down this list:

    scoring/   where a reward runs (sandbox, runner)         imports config only
    infra/     what any trainer needs                        imports config, scoring/
    perf/      exact fast paths                              none of model, rollout, grpo, run/,
                                                             episodes/ (callers pass model.py's in)
    episodes/  what the model is asked, over turns
    run/       around the loop
    dev/       benchmarks and counts: the only importer of grpo (besides tests/)

Every import statement counts, at the top of a file or inside a function (dev/layout.py).
"""

import os
import shutil

import pytest

from dev.layout import (
    FOLDERS,
    MAX_FUNCTION_LINES,
    MAX_MODULE_LINES,
    find_cycle,
    folder_graph,
    import_graph,
    long_definitions,
    long_modules,
    longest_chain,
    node_of,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN_CARD = {"grpo", "rollout", "rewards", "advantage", "loss", "config", "model"}
MAX_FLOORS = 10  # the longest import chain, a folder counted as one node
# what each folder may import of the project besides its own modules: root modules by name,
# folders as "name/"
MAY_IMPORT = {"scoring": {"config"}, "infra": {"config", "scoring/"}}
NEVER_IMPORTS = {"perf": {"model", "rollout", "grpo", "run/", "episodes/"}}
IMPORTERS_OF_GRPO = {"dev"}


def check_no_cycle(graph):
    """Fail naming the cycle, if the graph has one."""
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def as_named(node):
    """A floor node as the rules name it: "infra/" for a folder, "config" for a root module."""
    return node + "/" if node in FOLDERS else node


def test_the_root_holds_the_design_card_and_every_other_module_a_folder():
    root = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}
    assert root == DESIGN_CARD, f"at the root besides the design card: {sorted(root - DESIGN_CARD)}"
    for folder in FOLDERS:
        if folder != "tasks":  # task files are loaded by path (--task=NAME), not imported
            assert os.path.exists(os.path.join(ROOT, folder, "__init__.py")), folder
    assert not os.path.exists(os.path.join(ROOT, "config", "__init__.py"))  # run files, no package


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph(ROOT)
    # the walk sees the project: top-level imports, function-level ones, modules in folders
    assert {"loss", "perf.shared_prompt", "infra.checkpoint", "infra.log",
            "run.prepare"} <= graph["grpo"]
    assert "episodes.tools" in graph["run.prepare"]
    assert "infra.model_files" in graph["data.files"]  # imported inside a function
    assert {"config", "data.arith", "rewards"} <= graph["tasks.math"]
    # import_file composes task files at run time, and the audit runs as a module: no edges
    assert not any(node_of(n) in ("tasks", "run") for n in graph["episodes.task"])
    check_no_cycle(graph)
    check_no_cycle(folder_graph(graph))  # nor between folders: the floors are well defined


def test_each_folder_imports_only_what_lies_below_it():
    nodes = folder_graph(import_graph(ROOT))
    for folder, allowed in MAY_IMPORT.items():
        got = {as_named(n) for n in nodes[folder]}
        assert got <= allowed, f"{folder}/ imports {sorted(got - allowed)}: only {sorted(allowed)}"
    for folder, refused in NEVER_IMPORTS.items():
        got = {as_named(n) for n in nodes[folder]}
        assert not got & refused, f"{folder}/ imports {sorted(got & refused)}"
    importers = {n for n, deps in nodes.items() if "grpo" in deps}
    assert importers <= IMPORTERS_OF_GRPO, f"{sorted(importers)} import grpo: only dev/ may"
    assert not nodes["config"], f"config.py imports {sorted(nodes['config'])}: the bottom floor"


def test_the_imports_stack_at_most_ten_floors():
    chain = longest_chain(folder_graph(import_graph(ROOT)))
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)
    assert chain[-1] == "config" and chain[:2] == ["dev", "grpo"]


def test_no_function_or_module_is_too_long_to_read():
    assert not long_definitions(ROOT), f"over {MAX_FUNCTION_LINES} lines: {long_definitions(ROOT)}"
    assert not long_modules(ROOT), f"over {MAX_MODULE_LINES} lines: {long_modules(ROOT)}"


# ---------------------------------------------------------------- the checks find what they seek


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
    # through a package's module, by a from-import of the module itself: infra.parallel ->
    # perf.shared_prompt -> infra.parallel
    ("infra/parallel.py", "\nfrom perf import shared_prompt\n", None),
    # a relative import resolves against the package: episodes.tools -> episodes.turns -> ...
    ("episodes/tools.py", "\nfrom .turns import turn_seed\n", None),
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
    plant(root / "config.py", "\n\ndef planted(cfg):\n    from episodes.task import load_task\n")
    graph = import_graph(root)
    assert graph["config"] == {"episodes", "episodes.task"}
    assert "config" in find_cycle(graph)  # episodes.task imports config: a cycle as well


def test_a_folder_rule_broken_is_found(tmp_path):
    """perf/ importing model.py (the edge the caller's arguments replaced) and infra/ importing a
    root module each fail their rule; a floor added on top of the chain is counted."""
    root = copy_project(tmp_path)
    plant(root / "perf" / "cpu.py", "\n\ndef planted():\n    import model\n")
    plant(root / "infra" / "log.py", "\n\ndef planted():\n    import rewards\n")
    nodes = folder_graph(import_graph(root))
    assert "model" in nodes["perf"] and "rewards" in nodes["infra"]
    assert find_cycle(nodes)  # model -> perf -> model: the floors are gone
    before = len(longest_chain(folder_graph(import_graph(copy_project(tmp_path / "clean")))))
    plant(tmp_path / "clean" / "dev" / "planted.py", "import dev.layout\n")
    after = longest_chain(folder_graph(import_graph(tmp_path / "clean")))
    assert len(after) == before  # within dev/: the same floor
    plant(tmp_path / "clean" / "top.py", "import dev.layout\n")
    assert longest_chain(folder_graph(import_graph(tmp_path / "clean")))[0] == "top"


def test_a_long_function_is_counted(tmp_path):
    root = copy_project(tmp_path)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    plant(root / "advantage.py", f"\n\ndef planted():\n{body}")
    assert long_definitions(root) == [(MAX_FUNCTION_LINES + 1, "advantage.py:planted")]
