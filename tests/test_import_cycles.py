"""No module of xmem is in an import cycle (issue 24): function-level imports count, and so does the package face.

Read from the source with `ast`, not by importing, so a cycle that only a late import closes is seen too.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The xmem modules `path` imports anywhere in it; `from a import b` imports `a` and, if it is one, `a.b`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return (found & known) - {name}


def in_cycles(graph: dict[str, set[str]]) -> set[str]:
    """The modules from which an import path leads back to themselves."""
    looped = set()
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        if start in seen:
            looped.add(start)
    return looped


def test_no_module_is_in_an_import_cycle():
    files = {module_name(path): path for path in (ROOT / "xmem").rglob("*.py")}
    graph = {name: imports(path, name, set(files)) for name, path in files.items()}
    assert {"xmem.trace.runner", "xmem.trace"} <= graph["xmem.estimate"] | graph["xmem.trace"]  # the reader works
    assert {"xmem.cli.common", "xmem.cli.estimate"} <= graph["xmem.cli.check"]
    assert sorted(in_cycles(graph)) == []
