"""Every notebook of the series follows the same shape, and is committed clean.

Shape: a markdown title cell with "What you will learn" and "What you need"; one cell tagged
``parameters`` (papermill injects `make tutorial`'s values after it); a last code cell tagged ``cleanup``;
relative links that lead to files that exist. Clean: no outputs and no execution counts in git.
"""

import ast
import re
from pathlib import Path

import nbformat
import papermill
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _tagged(notebook, tag: str) -> list:
    return [cell for cell in notebook.cells if tag in cell.get("metadata", {}).get("tags", [])]


def test_the_series_is_numbered_without_gaps():
    numbers = [int(path.name[:2]) for path in NOTEBOOKS]
    assert numbers == list(range(1, len(NOTEBOOKS) + 1)) and len(numbers) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    code = [cell for cell in _read(path).cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] for cell in code), "strip outputs: jupyter nbconvert --clear-output --inplace"
    assert all(cell.execution_count is None for cell in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_says_what_and_what_for(path):
    first = _read(path).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "**What you will learn**" in first.source and "**What you need**" in first.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_holding_results_dir(path):
    notebook = _read(path)
    (cell,) = _tagged(notebook, "parameters")
    assert cell.cell_type == "code" and re.search(r"^results_dir = \"\"", cell.source, re.MULTILINE)
    # imports (and GPU) come before it, so its device-dependent defaults can use them
    before = "".join(c.source for c in notebook.cells[: notebook.cells.index(cell)] if c.cell_type == "code")
    assert "GPU = " in before and "from utils import" in before


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_papermill_sees_every_parameter(path):
    """One plain assignment per line: papermill cannot override a tuple unpacking or a line it cannot parse."""
    (cell,) = _tagged(_read(path), "parameters")
    assignments = [node for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)]
    assert all(len(a.targets) == 1 and isinstance(a.targets[0], ast.Name) for a in assignments)
    assert list(papermill.inspect_notebook(str(path))) == [a.targets[0].id for a in assignments]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ends_with_a_cleanup_cell(path):
    code = [cell for cell in _read(path).cells if cell.cell_type == "code"]
    assert _tagged(_read(path), "cleanup") == [code[-1]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_links_to_previous_and_next_resolve(path):
    text = "\n".join(cell.source for cell in _read(path).cells if cell.cell_type == "markdown")
    targets = [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "#"))]
    missing = [t for t in targets if not (path.parent / t.split("#")[0]).exists()]
    assert not missing, f"links to missing files: {missing}"
    index = NOTEBOOKS.index(path)
    neighbours = [p.name for p in NOTEBOOKS[max(index - 1, 0) : index + 2] if p != path]
    assert all(name in targets for name in neighbours), f"link the previous and next notebooks: {neighbours}"
