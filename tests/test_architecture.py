"""The `never:` rules of docs/architecture.md hold in the code: no module of a part imports a module of the part the
rule forbids (any import: module level, in a function, for type checking). The rules are read from the page, so the
page stays true."""

import re

from tests.test_import_cycles import ROOT, imports, module_name

RULE = re.compile(r"^never: (xmem[\w.]*) -> (xmem[\w.]*)$", re.MULTILINE)


def within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def broken(rules: list[tuple[str, str]], graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} imports {b} (never: {source} -> {target})" for source, target in rules
                  for a, bs in graph.items() if within(a, source) for b in bs if within(b, target))


def test_the_pages_never_rules_hold():
    rules = RULE.findall((ROOT / "docs" / "architecture.md").read_text())
    files = {module_name(path): path for path in (ROOT / "xmem").rglob("*.py")}
    graph = {name: imports(path, name, set(files)) for name, path in files.items()}
    assert len(rules) >= 10, "the page's rules were not read"
    named = {part for rule in rules for part in rule}
    assert all(any(within(m, part) for m in files) for part in named), "a rule names a part that does not exist"
    assert broken(rules, graph) == []
    # the check can fail: a rule the code breaks today is reported
    assert broken([("xmem.estimate", "xmem.simulate")], graph)
