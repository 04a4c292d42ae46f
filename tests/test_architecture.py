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


def test_the_page_holds_the_rules_the_boundary_needs():
    """Rules once broken and dropped from the page stay on it: analyze asks no Slurm, the tracer reads no site
    config and no simulator, and slurm leaves the warm tracer's internals alone."""
    rules = set(RULE.findall((ROOT / "docs" / "architecture.md").read_text()))
    assert {("xmem.analyze", "xmem.slurm"), ("xmem.trace", "xmem.simulate"), ("xmem.trace", "xmem.config"),
            ("xmem.slurm", "xmem.trace.warm")} <= rules


def test_a_rule_the_code_breaks_is_reported_by_name():
    graph = {"xmem.trace.runner": {"xmem.config"}, "xmem.config": {"xmem.units"}}
    assert broken([("xmem.trace", "xmem.config")], graph) == [
        "xmem.trace.runner imports xmem.config (never: xmem.trace -> xmem.config)"]
    assert broken([("xmem.config", "xmem.trace")], graph) == []


def test_the_tracers_default_memory_limit_is_the_sites():
    """Stated twice because config and trace import nothing of each other: the two must say the same."""
    from xmem.config import DEFAULT_TRACE_MEMORY_BYTES
    from xmem.trace.runner import DEFAULT_MEMORY_LIMIT_BYTES

    assert DEFAULT_MEMORY_LIMIT_BYTES == DEFAULT_TRACE_MEMORY_BYTES
