"""The architecture as tests: no import cycle between modules (lazy and type-only imports included), modules small
enough to read, and documentation references that resolve inside the repository (docs/architecture.md)."""

import re
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vpipe_lab"


def _cycles() -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), over every import grimp finds: top-level, inside functions and
    under ``if TYPE_CHECKING`` (a type-only cycle still ties two modules into one unit to understand)."""
    graph = grimp.build_graph("vpipe_lab", exclude_type_checking_imports=False)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return groups


def test_no_import_cycles() -> None:
    assert _cycles() == [], "modules that import each other (directly or around a loop)"


# A class lives in one file: the cap is a guide, never a reason to split a class (issue #59). The Session is the
# public face, its methods delegating to collaborators, each with the docstring users read in help().
WHOLE_CLASSES = {"vpipe_lab/control/session.py": 440}


def test_modules_stay_small() -> None:
    big = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > WHOLE_CLASSES.get(str(p.relative_to(ROOT)), 400)}
    assert big == {}, "modules over 400 lines: split them by what they are (a class by its collaborators)"


def test_every_module_says_what_it_is() -> None:
    silent = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if not p.read_text().lstrip().startswith('"""')]
    assert silent == []


def test_only_the_wire_reads_or_builds_message_bodies() -> None:
    """Message bodies are typed (wire/commands.py, wire/events.py): outside wire/ nothing reads ``.body`` or builds a
    ``Message`` by hand, so a field renamed on one side fails where the message is decoded, by name."""
    import ast

    found = []
    for path in PACKAGE.rglob("*.py"):
        if "wire" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "body":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .body")
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == "Message":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} builds a Message")
    assert found == []


def test_documentation_points_only_inside_the_repository() -> None:
    """Every ``something.md`` a docstring, doc or README names is a file of this repository."""
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    known = {p.name for p in ROOT.rglob("*.md") if "node_modules" not in p.parts and ".ci" not in p.parts}
    missing = {f"{src.relative_to(ROOT)}: {name}" for src in sources
               for name in re.findall(r"([\w.-]+\.md)\b", src.read_text()) if name not in known}
    assert missing == set()


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "static" not in p.parts)


def test_no_room_holds_more_than_fifteen_modules() -> None:
    """A folder past ~15 modules is several rooms sharing one: give each its own package."""
    crowded = {str(d.relative_to(ROOT)): n for d in {p.parent for p in _modules()}
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 15}
    assert crowded == {}


def test_no_function_runs_past_eighty_lines() -> None:
    """Counting its signature and decorators: a longer one does several things, each of which can be named."""
    import ast

    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := (node.end_lineno or start) - start + 1) > 80:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert long == {}


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md's module index lists each module by its path under vpipe_lab/ (a new one is added there)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    index = text[text.index("## Every module"):]
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", index, re.MULTILINE))
    modules = {str(p.relative_to(PACKAGE)) for p in _modules()}
    assert modules - named == set(), "add these to the module index of docs/architecture.md"
    assert named - modules == set(), "the module index names modules that are gone"


def test_a_module_name_repeats_only_where_the_architecture_page_says_why() -> None:
    """One name per thing: at most three basenames occur in two rooms, each listed under "Names that repeat" in
    docs/architecture.md with its reason (a repeat found here and not there is a module to rename)."""
    from collections import Counter

    counts = Counter(p.name for p in _modules() if p.name not in ("__init__.py", "__main__.py"))
    repeated = {name for name, n in counts.items() if n > 1}
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Names that repeat"):text.index("## Every module")]
    explained = set(re.findall(r"^- `(\w+\.py)`", section, re.MULTILINE))
    assert len(repeated) <= 3 and repeated == explained, (repeated, explained)
