"""The package structure docs/architecture.md describes: imports go one way between packages, no module imports
itself back through others (function-level imports included), and the docs never point outside the repository."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "data", "models", "decode", "distill", "eval", "train")
# package -> the packages it may import (docs/architecture.md, "The flow, and where each part lives")
ALLOWED = {"core": set(), "data": {"core"}, "models": {"core", "data"}, "decode": {"core", "data", "models"},
           "distill": {"core", "data", "models", "decode"}, "eval": {"core", "data", "models", "decode"},
           "train": {"core", "data", "models", "decode", "distill", "eval"}}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``name`` imports anywhere in its body (function-level imports too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            candidates = [mod, *(f"{mod}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_packages_import_one_way():
    bad = sorted(f"{a} imports {b}" for a, targets in _graph().items() for b in targets
                 if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]])
    assert not bad, "imports against the package order of docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_the_import_graph_sees_function_level_imports(tmp_path):
    """The checks above would pass vacuously if the parser missed imports: it must find both kinds."""
    graph = _graph()
    assert "core.io" in graph["train.run"]  # a module-level import
    assert "distill.draft_init" in graph["train.stages"]  # imported inside a function


def test_docs_point_only_inside_the_repository():
    texts = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".md", ".yaml", ".sh", ".toml"}
             and not any(part in {"outputs", ".git", "multirun"} or part.startswith(".") for part in
                         p.relative_to(ROOT).parts[:-1])]
    assert (ROOT / "docs" / "architecture.md").is_file()
    outside = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in texts if p.resolve() != Path(__file__).resolve()
               for m in re.finditer(r"DESIGN\.md|\.\./shared/DESIGN", p.read_text(errors="ignore"))]
    assert not outside, "references to a design file the repository does not contain:\n" + "\n".join(outside)


def test_readme_is_short_and_its_doc_links_resolve():
    """The README is the front door (at most 110 lines); the reference lives in docs/, and every link between
    them points at a file that exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 110
    links = [(ROOT, m) for m in re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", readme)]
    for page in (ROOT / "docs").glob("*.md"):
        links += [(page.parent, m) for m in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", page.read_text())]
    assert len(links) >= 10
    missing = sorted({str(base / target) for base, target in links if not (base / target).is_file()})
    assert not missing, f"links to files that do not exist: {missing}"


def _function_lengths(path: Path):
    """(name, lines) of every function in ``path``, from its first decorator (or ``def``) to its last line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.end_lineno - start + 1


def test_modules_and_functions_fit_one_screen_per_job():
    """At most 60 product modules (eval/ at most 12), none over 800 lines, no function over 100 lines (docstrings
    included), the benchmark script under 300 (docs/architecture.md, "The flow, and where each part lives"). ``__init__.py`` files that only
    re-export count too when they hold code."""
    modules = _modules()
    counted = {m: p for m, p in modules.items() if p.name != "__init__.py" or p.read_text().strip()}
    assert len(counted) <= 60, f"{len(counted)} product modules (at most 60): {sorted(counted)}"
    in_eval = [m for m, p in counted.items() if m.split(".")[0] == "eval"]
    assert len(in_eval) <= 12, f"{len(in_eval)} modules in eval/ (at most 12): {sorted(in_eval)}"
    long_modules = [f"{m} ({len(p.read_text().splitlines())} lines)" for m, p in modules.items()
                    if len(p.read_text().splitlines()) > 800]
    long_functions = [f"{m}.{name} ({n} lines)" for m, p in modules.items() for name, n in _function_lengths(p)
                      if n > 100]
    assert not long_modules and not long_functions, f"over the limits: {long_modules + long_functions}"
    assert len((ROOT / "scripts" / "bench_decode.py").read_text().splitlines()) < 300


def test_data_holds_data_modules_only():
    """data/ reads, formats, splits and tokenizes data; loading models, the CLI, errors and device plumbing live in
    models/ and core/ (docs/architecture.md)."""
    names = sorted(p.stem for p in (ROOT / "data").glob("*.py") if p.name != "__init__.py")
    assert names == ["blocks", "config", "loading", "registry", "text"], names


def test_no_package_imports_another_packages_private_names():
    """A package's underscore names and modules are its own: another package (or a script) imports only public
    ones."""
    bad = []
    files = {**_modules(), **{f"scripts.{p.stem}": p for p in (ROOT / "scripts").glob("*.py")}}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            parts = node.module.split(".")
            if parts[0] not in PACKAGES or parts[0] == name.split(".")[0]:
                continue
            private = [p for p in parts[1:] if p.startswith("_") and p != "__main__"]
            private += [a.name for a in node.names if a.name.startswith("_")]
            bad += [f"{name} imports {node.module}: {p}" for p in private]
    assert not bad, "imports of another package's private names:\n" + "\n".join(bad)
