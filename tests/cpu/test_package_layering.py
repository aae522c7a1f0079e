"""The package's layering, read from its source: which packages may import which (every import counts, those inside
functions too; only `if TYPE_CHECKING:` blocks, which never run, are left out), and no import cycle."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_rl"
EXECUTORS = ("controller", "trainer", "rollout", "ddma")
PLUG_INS = ("algorithms", "rewards", "data", "models", "tools")


def _module_name(path: pathlib.Path) -> str:
    parts = ("megatron_rl",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """module -> the megatron_rl modules it imports (a `from package import name` is the submodule `name` when there
    is one, else the package)."""
    sources = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text())
        skipped, imported = _type_checking_lines(tree), set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skipped:
                continue
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("megatron_rl")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_rl"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    imported.add(full if full in sources else node.module)
        graph[module] = imported - {module}
    return graph


GRAPH = import_graph()


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _violations(rule) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps if not rule(m, d))


def test_the_graph_sees_the_package():
    """Not vacuous: the walk finds the executors and the imports between them."""
    assert {"megatron_rl.controller.loop", "megatron_rl.trainer.executor", "megatron_rl.config.setup"} <= set(GRAPH)
    assert "megatron_rl.controller.buffer" in GRAPH["megatron_rl.controller.loop"]


def test_there_is_no_import_cycle():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("rule,why", [
    (lambda m, d: _package(d) != "bench" or _package(m) == "bench", "only bench/ imports bench/"),
    (lambda m, d: d != "megatron_rl.train", "nothing imports the entry point"),
    (lambda m, d: _package(m) != "runtime" or _package(d) == "runtime",
     "runtime/ is the bottom: it imports only itself"),
    (lambda m, d: _package(m) not in PLUG_INS or _package(d) in PLUG_INS + ("runtime",),
     "plug-ins import plug-ins and runtime/ only (never an executor, config/, checkpoint/ or observability/)"),
    (lambda m, d: _package(m) != "config" or _package(d) not in EXECUTORS or d == f"megatron_rl.{_package(d)}",
     "config/ reaches an executor only through its front door (the package itself), never its internals"),
    (lambda m, d: _package(m) not in EXECUTORS or _package(d) != "config" or d == "megatron_rl.config.setup",
     "executors read the run setup (config.setup), never the flags' parsing or the dry run"),
])
def test_layering(rule, why):
    assert not _violations(rule), f"{why}: {_violations(rule)}"
