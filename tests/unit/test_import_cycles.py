"""No import cycle inside justfit: every module can be read, and moved, knowing only what is below it.

The layers contract (pyproject.toml) orders the rooms; this checks the modules within a room too, where
a cycle (two modules each importing the other, even inside a function) would otherwise go unnoticed.
"""

import pytest

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("justfit")
    cycles = sorted((a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                    if graph.find_shortest_chain(b, a))
    assert cycles == [], f"import cycles: {cycles}"
