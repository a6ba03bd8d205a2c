#!/usr/bin/env python
"""The import graph of dcvit and train_imagenet, read from the source (nothing is imported).

    python scripts/import_graph.py            # the graph as docs/architecture.md shows it
    python scripts/import_graph.py --edges    # one 'module -> module [deferred]' line per import

An import at module level is an edge; one inside a function (loaded on first use) is a
*deferred* edge, printed in brackets; imports under ``if TYPE_CHECKING:`` are left out (they
never run). ``tests/test_import_graph.py`` checks the allowed directions on these edges and
that docs/architecture.md shows the graph this script prints.
"""
import argparse
import ast
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dcvit", "train_imagenet")
# Shown as one node in the summary graph (their insides are one job each).
GROUPS = ("dcvit.report", "dcvit.kernels", "train_imagenet.data")

__all__ = ["Edge", "edges", "summary", "main"]


class Edge(NamedTuple):
    source: str      # importing module, e.g. 'dcvit.attention'
    target: str      # imported project module, e.g. 'dcvit.functional'
    deferred: bool   # inside a function: runs on first use, not at import


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(module: str, is_package: bool, level: int, name: Optional[str]) -> str:
    """The absolute name of ``from <level dots><name> import ...`` inside ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
        or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, deferred: bool = False):
    """(names, deferred) of every import statement, skipping TYPE_CHECKING blocks."""
    for node in ast.iter_child_nodes(tree):
        if _type_checking_block(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, deferred
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _imports(node, inner)


def edges() -> List[Edge]:
    """Every import of one project module by another, module-level and deferred."""
    modules = _modules()
    found: Set[Edge] = set()
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, deferred in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(module, is_package, node.level, node.module)
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:      # 'dcvit.fused.IMPLS' -> 'dcvit.fused'
                    target = target.rpartition(".")[0]
                if target and target != module and target.split(".")[0] in PACKAGES:
                    found.add(Edge(module, target, deferred))
    # An edge that is both module-level and deferred is module-level.
    eager = {(e.source, e.target) for e in found if not e.deferred}
    return sorted(e for e in found if not (e.deferred and (e.source, e.target) in eager))


def _group(module: str) -> str:
    return next((g for g in GROUPS if module == g or module.startswith(g + ".")), module)


def summary(all_edges: Optional[List[Edge]] = None) -> str:
    """One line per module: what it imports at import time, and [on first use]. ``dcvit`` is
    the package itself (``import dcvit``: the model registration)."""
    lines = []
    graph: Dict[str, Dict[str, bool]] = {}
    for e in all_edges if all_edges is not None else edges():
        source, target = _group(e.source), _group(e.target)
        if source == target:
            continue
        targets = graph.setdefault(source, {})
        targets[target] = targets.get(target, True) and e.deferred
    for module in sorted(set(map(_group, _modules())) - {"train_imagenet"}):
        targets = graph.get(module, {})
        now = [t for t, d in sorted(targets.items()) if not d]
        later = [t for t, d in sorted(targets.items()) if d]
        text = ", ".join(now) or "-"
        if later:
            text += f"   [on\0first\0use: {', '.join(later)}]"     # \0: not a place to wrap
        lines += [line.replace("\0", " ") for line in textwrap.wrap(
            text, width=100, initial_indent=f"{module:<27} -> ", subsequent_indent=" " * 31,
            break_on_hyphens=False)]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edges", action="store_true", help="every edge, one per line")
    args = p.parse_args(argv)
    if args.edges:
        for e in edges():
            print(f"{e.source} -> {e.target}" + (" [deferred]" if e.deferred else ""))
    else:
        print(summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
