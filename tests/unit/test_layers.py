"""The import structure of ``miles_async``, read from the source with ``ast``: no import cycle between its modules,
no import from a lower layer up to a higher one, and each inference engine kept to its own folder.

Every import counts, at module level or inside a function. Those under ``if TYPE_CHECKING:`` only name types
for annotations and never run: the layers let them by (a trainer names the rollout's batch type that way), but
no cycle may close through them, since a two-way dependency by annotation is still one in the design. Nor through
a package's face: ``from pkg import mod`` reads ``pkg/__init__.py`` too, so a submodule imports its siblings by
their own names (as ``shared/tools/import_cycles.py --with-type-checking`` reads them).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "miles_async"

# Low to high: a module may import from its own layer's package and from lower layers only; packages that share
# a layer are siblings and import nothing from each other. The loop (train_async.py) sits above all of them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("vision",),  # a vision-language model's HF side (images, processor, 3-D positions): imports nothing of ours
    ("utils", "assets"),  # checkpoint, tracking, plots, async helpers; tiny models and task data
    ("algorithms",),  # advantages, losses and reward types: pure functions
    ("config",),  # flags -> typed configs; each engine kind's weight routes (engine_kinds.py)
    ("inference",),  # the engines: each kind's client and launcher (engines.py)
    ("weights",),  # the weight path's record, sources and routes: what the trainers send with
    ("rollout", "backends"),  # the rollout side and the training side
    ("ray",),  # the actors that hold them
    ("weights.driver",),  # one weight update end to end, over the train group and the inference controller
    ("run", "arguments", "control"),  # the Run object; the command line; the control API on a running loop
)

# Imports that the layers would allow but that skip the layer meant to stand between: (importer, imported)
# packages, and why not.
SKIPPED: dict[tuple[str, str], str] = {
    ("backends", "inference"): "the trainers reach the engines only through the weight routes (weights/)",
}

# Upward imports that exist today and belong to other changes; each is (importer, imported module). An entry
# that no longer exists fails the test too, so the list only shrinks.
KNOWN_UPWARD: set[tuple[str, str]] = set()

ENGINE_FOLDERS = ("embedded", "sglang", "vllm")


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            getattr(node.test, "id", None) == "TYPE_CHECKING" or getattr(node.test, "attr", None) == "TYPE_CHECKING"
        ):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path], every: bool = False) -> dict[str, int]:
    """The modules of this package that module ``name`` imports, each with the line of its first import; with
    ``every``, those under ``if TYPE_CHECKING:`` too, and the package that ``from pkg import mod`` names."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = set() if every else _type_checking_nodes(tree)
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` the module mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            targets += [base] if every else []
        for target in targets:
            if target.split(".")[0] == PACKAGE and target != name:
                found.setdefault(target, node.lineno)
    return found


def _graph(every: bool = False) -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: _imports(name, path, modules, every) for name, path in modules.items()}


def _top(module: str) -> str:
    """The unit of LAYERS a module belongs to: its most specific listed package or module ("weights.driver"),
    else its top-level package."""
    parts = module.split(".")[1:]
    listed = {unit for units in LAYERS for unit in units}
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in listed:
            return ".".join(parts[:n])
    return parts[0] if parts else ""


def _layer(top: str) -> int:
    for i, tops in enumerate(LAYERS):
        if top in tops:
            return i
    raise AssertionError(f"{PACKAGE}.{top} has no layer: add it to LAYERS in {__file__}")


def _upward(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], str]:
    """Every import that goes up a layer or sideways to a sibling, with where it is."""
    bad = {}
    for importer, imported in graph.items():
        for target, line in imported.items():
            a, b = _top(importer), _top(target)
            if a and b and a != b and _layer(a) <= _layer(b):
                kind = "up to" if _layer(a) < _layer(b) else "sideways to its sibling"
                bad[(importer, target)] = f"{_where(importer)}:{line} imports {target} ({a} {kind} {b})"
    return bad


def _where(module: str) -> str:
    return str(_modules()[module].relative_to(ROOT))


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_goes_up_a_layer():
    bad = _upward(_graph())
    new = sorted(where for edge, where in bad.items() if edge not in KNOWN_UPWARD)
    assert new == [], "imports from a lower layer up to a higher one (see LAYERS):\n" + "\n".join(new)
    gone = sorted(KNOWN_UPWARD - set(bad))
    assert gone == [], f"no longer imported, remove from KNOWN_UPWARD: {gone}"


def test_no_import_skips_the_layer_between():
    bad = sorted(
        f"{_where(importer)}:{line} imports {target} ({why})"
        for importer, imported in _graph().items()
        for target, line in imported.items()
        for (a, b), why in SKIPPED.items()
        if _top(importer) == a and _top(target) == b
    )
    assert bad == []


def test_no_import_cycle():
    graph = _graph(every=True)
    for importer, target in KNOWN_UPWARD:  # each known upward import closes a cycle already reported above
        graph.get(importer, {}).pop(target, None)
    cycles = _cycles(graph)
    assert cycles == [], "modules that import each other, directly or around a circle:\n" + "\n".join(map(str, cycles))


def test_each_engine_stays_in_its_folder():
    """An engine folder imports no other engine's; outside them only engines.py (the registry) names them."""
    inference = f"{PACKAGE}.inference"
    bad = []
    for importer, imported in _graph().items():
        if not importer.startswith(inference + "."):
            continue
        own = importer.split(".")[2]
        for target, line in imported.items():
            engine = target.split(".")[2] if target.startswith(inference + ".") else None
            if engine in ENGINE_FOLDERS and engine != own and importer != f"{inference}.engines":
                bad.append(f"{_where(importer)}:{line} imports {target}")
    assert bad == []


def test_the_rules_see_what_they_check():
    """The checks above read the real graph: known edges of each kind are in it."""
    graph = _graph()
    assert "miles_async.config.engine_kinds" in graph["miles_async.inference.engines"]
    assert "miles_async.inference.sglang.client" in graph["miles_async.inference.engines"]
    assert "miles_async.config" not in graph["miles_async.utils.tracking"]  # under TYPE_CHECKING
    assert "miles_async.config" in _graph(every=True)["miles_async.utils.tracking"]
    assert "miles_async.config" in _graph(every=True)["miles_async.config.placement"]  # from the face
    assert "miles_async.weights.update" in graph["miles_async.weights.driver"]
    assert (_top("miles_async.weights.driver"), _top("miles_async.weights.http")) == ("weights.driver", "weights")
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
