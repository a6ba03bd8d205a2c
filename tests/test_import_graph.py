"""The allowed directions of imports, checked on the source (scripts/import_graph.py)."""
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


graph = _load_graph()
EDGES = graph.edges()


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offending(source_pkg: str, target_pkg: str):
    return [e for e in EDGES if within(e.source, source_pkg) and within(e.target, target_pkg)]


def test_the_graph_is_read_from_the_source():
    pairs = {(e.source, e.target) for e in EDGES}
    assert ("dcvit.core", "dcvit.functional") in pairs and ("train_imagenet.data.shards", "dcvit.schema") in pairs
    assert ("dcvit", "dcvit.models") in pairs                  # import dcvit registers the models
    deferred = {(e.source, e.target) for e in EDGES if e.deferred}
    assert ("dcvit.models", "dcvit.attention") in deferred     # the layer loads with the first model


def test_the_architecture_page_shows_this_graph():
    page = (ROOT / "docs" / "architecture.md").read_text()
    shown = page.split("## The import graph", 1)[1].split("```\n", 2)[1].rstrip("\n")
    assert shown == graph.summary(EDGES), "regenerate it: python scripts/import_graph.py"


def test_no_submodule_is_named_as_a_public_name():
    """``dcvit.compose`` is a function: a submodule of that name would be shadowed by it
    (``import dcvit.compose as m`` would give the function)."""
    import dcvit
    package = ROOT / "dcvit"
    assert [n for n in dcvit.__all__ if (package / f"{n}.py").exists() or (package / n).is_dir()] == []


def test_dcvit_never_imports_the_trainer():
    assert offending("dcvit", "train_imagenet") == []


def test_the_model_code_never_imports_the_measurement_tools():
    """dcvit.bench (and the report, which times too) import the model code, never the reverse."""
    measuring = ("dcvit.bench", "dcvit.report")
    assert [e for e in EDGES if within(e.target, "dcvit.bench")
            and not any(within(e.source, m) for m in measuring)] == []


def test_kernels_import_no_other_dcvit_module():
    """Kernels sit behind the dispatcher (dcvit.fused) and never import it or anything above."""
    bad = [e for e in EDGES if within(e.source, "dcvit.kernels") and not within(e.target, "dcvit.kernels")]
    assert bad == []


@pytest.mark.parametrize("leaf", ["dcvit.functional", "dcvit.io", "dcvit.schema", "dcvit.bench.timing", "dcvit.cli",
                                  "train_imagenet.config", "train_imagenet.distributed",
                                  "train_imagenet.metrics", "train_imagenet.logs"])
def test_the_bottom_of_each_stack_imports_nothing_of_the_project(leaf):
    """functional is the maths everything is tested against; config, metrics and logs stand alone;
    io/schema/timing/cli are utilities (config may use dcvit.io and dcvit.cli, which import
    nothing of the project)."""
    allowed = {"dcvit.io", "dcvit.cli"} if leaf == "train_imagenet.config" else set()
    assert [e for e in EDGES if e.source == leaf and e.target not in allowed] == []


def test_file_formats_need_only_the_standard_library():
    for name in ("io", "schema"):
        tree = ast.parse((ROOT / "dcvit" / f"{name}.py").read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert roots <= set(sys.stdlib_module_names), f"dcvit.{name} imports {roots - set(sys.stdlib_module_names)}"


def test_the_data_flow_has_no_way_back():
    """config -> data -> model -> engine: an earlier stage never imports a later one, and
    nothing imports the wiring (__main__), scripts included."""
    order = ["train_imagenet.config", "train_imagenet.data", "train_imagenet.model", "train_imagenet.engine"]
    back = [e for e in EDGES if graph._group(e.source) in order and graph._group(e.target) in order
            and order.index(graph._group(e.target)) > order.index(graph._group(e.source))]
    assert back == []
    assert [e for e in EDGES if e.target == "train_imagenet.__main__"] == []
    for script in sorted((ROOT / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "train_imagenet.__main__" not in names, f"{script.name} imports the trainer's wiring"


def test_the_report_reads_files_and_never_the_trainer():
    assert offending("dcvit.report", "train_imagenet") == []
    assert ("dcvit.report.results", "dcvit.schema") in {(e.source, e.target) for e in EDGES}


def test_no_circle_even_through_imports_on_first_use():
    """A deferred import does not hide a cycle: the graph of all edges is acyclic."""
    succ = {}
    for e in EDGES:
        succ.setdefault(e.source, set()).add(e.target)
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in succ.get(node, ()):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(succ):
        if node not in state:
            visit(node, [])


