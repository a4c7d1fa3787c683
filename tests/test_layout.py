"""The package's folders are its layers (docs/architecture.md): each subpackage imports only from
the ones below it, no module imports another in a cycle, the framework never imports the reference
models, and nothing grows past 400 lines a module (250 in the config package) or 120 lines a definition.

The checks read the source (ast), so a violation anywhere, in a function body too, fails here
before it can hide behind a lazy import.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# lowest first: a module may import its own layer and the ones before it
LAYERS = ("core", "nn", "parallel", "io", "runtime", "train", "serve", "plan", "cli")
MAX_MODULE_LINES, MAX_DEFINITION_LINES = 400, 120
MAX_CONFIG_LINES = 250  # each file of the config package (`meshpar/core/config/`)


def modules(package: Path) -> dict[str, Path]:
    """'meshpar.core.mesh' -> its file, for every module of the framework (not the reference models or
    configs that the install puts beside it)."""
    return {
        ".".join((package.name, *p.relative_to(package).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in sorted(package.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def layer_of(module: str) -> str | None:
    """'meshpar.train.step' -> 'train'; 'meshpar.cli' -> 'cli'; the package itself (the lazy public API) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, function bodies included; relative
    imports resolved; `from meshpar.x import y` counts as meshpar.x.y when that is a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".")[: -node.level + (path.name == "__init__.py") or None]
                base = ".".join([*here, base] if base else here)
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def violations(package: Path) -> list[str]:
    """Every broken layering rule in `package` (meshpar or a copy of it), one line each."""
    mods = modules(package)
    name = package.name
    found, graph = [], {m: set() for m in mods}
    for mod, path in mods.items():
        layer = layer_of(mod)
        if mod != name and layer not in LAYERS:
            found.append(f"{mod}: not in a layer; put it in one of {', '.join(LAYERS[:-1])}")
        for line, target in imports_of(path, mod):
            if target.split(".")[:2] in ([name, "models"], ["models"]) or target == "models":
                found.append(f"{mod}:{line} imports the reference models ({target}); name them by string instead")
                continue
            if target.split(".")[0] != name:
                continue
            # the longest module prefix of the target (a name imported from a module is that module)
            dep = next(
                (
                    ".".join(target.split(".")[:k])
                    for k in range(target.count(".") + 1, 0, -1)
                    if ".".join(target.split(".")[:k]) in mods
                ),
                None,
            )
            if dep is None or dep == mod:
                continue
            if dep == name and target != f"{name}.__version__":
                found.append(f"{mod}:{line} imports the public API ({target}); import the module that defines it")
                continue
            graph[mod].add(dep)
            have, want = layer_of(mod), layer_of(dep)
            if have in LAYERS and want in LAYERS and LAYERS.index(want) > LAYERS.index(have):
                found.append(f"{mod}:{line} imports {dep}: layer '{have}' must not import the higher layer '{want}'")
    found += cycles(graph)
    for mod, path in mods.items():
        n = len(path.read_text().splitlines())
        cap = MAX_CONFIG_LINES if mod.startswith(f"{name}.core.config") else MAX_MODULE_LINES
        if n > cap:
            found.append(f"{mod}: {n} lines (at most {cap}); split it along an idea")
        found += [
            f"{mod}:{d.lineno} {d.name}: {d.end_lineno - d.lineno + 1} lines (at most {MAX_DEFINITION_LINES})"
            for d in ast.walk(ast.parse(path.read_text()))
            if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and d.end_lineno - d.lineno + 1 > MAX_DEFINITION_LINES
        ]
    return found


def cycles(graph: dict[str, set]) -> list[str]:
    state, found = {}, []

    def visit(n, stack):
        state[n] = "open"
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                found.append("import cycle: " + " -> ".join(stack[stack.index(m) :] + [m]))
            elif m not in state:
                visit(m, stack + [m])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_the_framework_keeps_its_layers():
    assert violations(REPO / "meshpar") == []


def module_table(path: Path) -> list[str]:
    """The modules docs/architecture.md's table names, as 'layer.module' ('core.config.schema')."""
    import re

    rows, layer = [], None
    for lay, mod in re.findall(r"^\| *(\w*) *\| `([\w.]+)` \|", path.read_text(), re.M):
        layer = lay or layer
        rows.append(mod if mod == layer else f"{layer}.{mod}")
    return rows


def test_the_module_table_is_the_one_list_of_modules():
    """docs/architecture.md's table names every module of the framework once, and nothing else."""
    listed = module_table(REPO / "docs" / "architecture.md")
    have = {m.split(".", 1)[1] for m, p in modules(REPO / "meshpar").items() if "." in m and p.name != "__init__.py"}
    assert sorted(m for m in listed if listed.count(m) > 1) == []
    assert sorted(have - set(listed)) == [], "modules missing from docs/architecture.md's table"
    assert sorted(set(listed) - have) == [], "the table names modules that do not exist"


def test_the_reference_models_keep_the_size_limits():
    mods = modules(REPO / "models")
    assert mods
    for mod, path in mods.items():
        assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES, mod
        for d in ast.walk(ast.parse(path.read_text())):
            if isinstance(d, (ast.FunctionDef, ast.ClassDef)):
                assert d.end_lineno - d.lineno + 1 <= MAX_DEFINITION_LINES, f"{mod}.{d.name}"


@pytest.mark.parametrize(
    "module, text, expected",
    [
        (
            "core/mesh2.py",
            "from meshpar.train.step import Trainer\n",
            "layer 'core' must not import the higher layer 'train'",
        ),
        (
            "nn/late.py",
            "def f():\n    from meshpar.serve import engine\n",
            "layer 'nn' must not import the higher layer 'serve'",
        ),
        ("io/rel.py", "from ..plan import inspect\n", "layer 'io' must not import the higher layer 'plan'"),
        ("core/api.py", "from meshpar import Trainer\n", "imports the public API (meshpar.Trainer)"),
        ("train/ref.py", "import meshpar.models.decoder\n", "imports the reference models"),
        ("flat.py", "x = 1\n", "meshpar.flat: not in a layer"),
        (
            "core/a.py",
            "from meshpar.core import b\n",
            "import cycle: meshpar.core.a -> meshpar.core.b -> meshpar.core.a",
        ),
        ("core/long.py", "def f():\n" + "    x = 1\n" * 121, "f: 122 lines (at most 120)"),
        ("core/config/big.py", "x = 1\n" * 251, "meshpar.core.config.big: 251 lines (at most 250)"),
    ],
)
def test_each_rule_catches_its_violation(tmp_path, module, text, expected):
    """The checker itself: a copy of the package with one violation added reports exactly that one."""
    import shutil

    pkg = tmp_path / "meshpar"
    shutil.copytree(REPO / "meshpar", pkg, ignore=shutil.ignore_patterns("__pycache__", "models", "configs"))
    (pkg / "core" / "b.py").write_text("from meshpar.core import a\n" if module == "core/a.py" else "")
    (pkg / module).write_text(text)
    found = violations(pkg)
    assert len(found) == 1 and expected in found[0], found


def test_every_public_name_resolves():
    """`meshpar.X` for every name of the lazy public API (`meshpar._API`) imports and is defined where
    the table says: a module moved without its entry fails here, not in a user's program."""
    import importlib

    import meshpar

    missing = [n for n, mod in meshpar._API.items() if not hasattr(importlib.import_module(mod), n)]
    assert missing == [] and len(meshpar._API) >= 44


WHOLE_CONFIG_FUNCTIONS = 35  # issue 42's goal, reached: lower it as components take their sections


def whole_config_functions(package: Path) -> list[str]:
    """Every function of the framework with a parameter named `cfg` (the whole run config)."""
    out = []
    for mod, path in modules(package).items():
        for d in ast.walk(ast.parse(path.read_text())):
            if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if "cfg" in [a.arg for a in d.args.posonlyargs + d.args.args + d.args.kwonlyargs]:
                    out.append(f"{mod}:{d.lineno} {d.name}")
    return out


def test_components_take_their_sections():
    """At most WHOLE_CONFIG_FUNCTIONS functions take the whole config (the CLI, the loop, the planner's
    entry points, the config package, the objects users build: docs/architecture.md, "Who sees the
    whole config"), and none reads it through another object (`trainer.cfg`, `engine.cfg`, ...)."""
    found = whole_config_functions(REPO / "meshpar")
    print(f"\n{len(found)} functions take the whole config (at most {WHOLE_CONFIG_FUNCTIONS})")
    assert len(found) <= WHOLE_CONFIG_FUNCTIONS, "\n".join(found)
    doors = [
        f"{mod}:{n.lineno} {ast.unparse(n)}"
        for mod, path in modules(REPO / "meshpar").items()
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute)
        and n.attr == "cfg"
        and not (isinstance(n.value, ast.Name) and n.value.id == "self")
    ]
    assert doors == [], "the run config read through another object; pass the section instead"


def test_every_local_import_says_why():
    """A meshpar module imported inside a function (not at the top of its module) says why on its line
    (`# local: ...`: an optional dependency it loads only when used, JAX kept out of loading a config);
    the command line (`meshpar/cli/`) imports in its functions by design, said once in its docstring."""
    unexplained = []
    for mod, path in modules(REPO / "meshpar").items():
        if mod.startswith("meshpar.cli"):
            continue
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if (name or "").startswith("meshpar") and "# local:" not in lines[node.lineno - 1]:
                    unexplained.append(f"{mod}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert unexplained == [], "import it at the top of the module, or say why it is local (# local: ...)"
