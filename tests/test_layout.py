"""The package's layering, read from its source: imports point one way and form no cycle.

entrypoints -> engine -> executor -> worker -> models -> attention -> distributed -> the bottom
(config, request, images, logger). `vllm_omni.testing` (test doubles) sits above them all: it imports production,
and nothing outside it imports it, in any form (a rank reaches its doubles through worker/hooks.py's RankHooks).
"""

from __future__ import annotations

import ast
import pathlib
import re

import vllm_omni

PACKAGE = pathlib.Path(vllm_omni.__file__).parent
LAYERS = {  # a module's layer is that of the longest prefix it has here; the rest is the bottom (0)
    "vllm_omni.entrypoints": 7,
    "vllm_omni.diffusion.engine": 6,
    "vllm_omni.diffusion.executor": 5,
    "vllm_omni.diffusion.worker": 4,
    "vllm_omni.diffusion.models": 3,
    # Model id -> folder -> spec: torch-free, it reads the families' specs, and the engine reads a model through it
    # before any worker starts.
    "vllm_omni.diffusion.model_source": 3,
    "vllm_omni.diffusion.attention": 2,
    "vllm_omni.diffusion.distributed": 1,
    "vllm_omni.testing": 8,  # test doubles: they import production, never the reverse
}
TESTING = "vllm_omni.testing"


def layer(module: str) -> int:
    prefixes = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(prefixes, key=len)] if prefixes else 0


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(name: str, top_level_only: bool, type_checking: bool = False) -> list[tuple[str, int]]:
    """The package modules `name` imports, with their lines; `TYPE_CHECKING` blocks left out unless `type_checking`,
    and with `top_level_only` those inside functions too (they run later, not while the module loads)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not type_checking:
                continue
            if isinstance(child, ast.Import) and (top or not top_level_only):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and (top or not top_level_only):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.append((full if full in MODULES else base, child.lineno))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), True)
    return [(module, line) for module, line in found if module in MODULES]


def test_imports_point_down_the_layers():
    upward = [
        f"{name}:{line} imports {module}"
        for name in MODULES
        if name != "vllm_omni"
        for module, line in imports(name, top_level_only=False)
        if layer(module) > layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_nothing_outside_testing_imports_testing():
    """Counting imports inside functions and under `TYPE_CHECKING`: production reaches its test doubles only
    through the hooks a rank is given (diffusion/worker/hooks.py)."""
    offenders = [
        f"{name}:{line} imports {module}"
        for name in MODULES
        if not (name == TESTING or name.startswith(TESTING + "."))
        for module, line in imports(name, top_level_only=False, type_checking=True)
        if module == TESTING or module.startswith(TESTING + ".")
    ]
    assert not offenders, "\n".join(offenders)


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles: list[str] = []
    state: dict[str, str] = {}

    def walk(name: str, path: list[str]) -> None:
        state[name] = "open"
        for module in sorted(graph[name]):
            if state.get(module) == "open":
                cycles.append(" -> ".join(path[path.index(module) :] + [module]))
            elif module not in state:
                walk(module, [*path, module])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    return cycles


# Cycles through imports inside functions or `TYPE_CHECKING` blocks that are still to be broken (issue 45).
KNOWN_CYCLES: set[str] = set()


def import_graph(top_level_only: bool, type_checking: bool) -> dict[str, set[str]]:
    graph = {name: {module for module, _ in imports(name, top_level_only, type_checking)} - {name} for name in MODULES}
    # A package's __init__ is loaded before its modules: an edge to a parent package is no cycle of ours.
    return {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}


def test_no_import_cycle():
    cycles = find_cycles(import_graph(top_level_only=True, type_checking=False))
    assert not cycles, "\n".join(cycles)


def _rotated(cycle: str) -> str:
    """A cycle written from its smallest module, so one cycle found from two starts reads the same."""
    names = cycle.split(" -> ")[:-1]
    start = names.index(min(names))
    names = names[start:] + names[:start]
    return " -> ".join([*names, names[0]])


def test_no_import_cycle_through_functions_or_type_checking_but_those_known():
    cycles = {_rotated(c) for c in find_cycles(import_graph(top_level_only=False, type_checking=True))}
    assert cycles <= KNOWN_CYCLES, "\n".join(sorted(cycles - KNOWN_CYCLES))


def test_nothing_under_diffusion_imports_a_web_framework_or_vllm():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in (PACKAGE / "diffusion").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for module in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if module.split(".")[0] in {"fastapi", "starlette", "uvicorn", "vllm"}
    ]
    assert not offenders, offenders


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The layering tests can fail: they read real imports, order the layers and find a cycle."""
    runner = "vllm_omni.diffusion.worker.runner"
    assert "vllm_omni.diffusion.models.spec" in {module for module, _ in imports(runner, top_level_only=True)}
    assert layer("vllm_omni.entrypoints.omni") > layer(runner) > layer("vllm_omni.diffusion.models.spec") > 0
    assert layer("vllm_omni.diffusion.config") == layer("vllm_omni.diffusion.protocol") == 0  # the contracts
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    # The walker sees an import inside a function and one under TYPE_CHECKING (the worker has both).
    worker = "vllm_omni.diffusion.worker.worker"
    every_form = {module for module, _ in imports(worker, top_level_only=False, type_checking=True)}
    top_level = {module for module, _ in imports(worker, top_level_only=True)}
    late = {"vllm_omni.diffusion.distributed.parallel_state", "vllm_omni.diffusion.worker.runner"}
    assert late <= every_form and not late & top_level
    assert layer(TESTING) > layer("vllm_omni.entrypoints.omni")
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_environment_variables_are_spelled_only_in_envs():
    """Every VLLM_OMNI_* variable is declared in vllm_omni/envs.py; code elsewhere reads it by that name (docstrings
    and comments may mention it)."""
    offenders = []
    for name, path in MODULES.items():
        if name == "vllm_omni.envs":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        offenders += [
            f"{name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "VLLM_OMNI_" in node.value
            and id(node) not in docstrings
        ]
    assert not offenders, offenders


# What users call the served families, and their packages' names.
FAMILY_NAMES = re.compile(
    r"Qwen|FLUX|Flux|flux2|klein|Wan2|\bWan\b|wan22|Hunyuan|hunyuan|Z-Image|ZImage|z_image|GLM|Glm|glm_image|LTX"
)
# Where naming families is the point: the list of family packages, diffusers' private members of the families'
# classes (each tested on the pin), the Qwen tokenizer the tiny models of several families share, and the request
# fields' help a user reads (what a field means on each family).
NAMES_FAMILIES = {
    "vllm_omni.diffusion.models.registry",
    "vllm_omni.diffusion.diffusers_compat",
    "vllm_omni.diffusion.models.tiny_qwen_tokenizer",
    "vllm_omni.diffusion.engine.request_fields",
}


def test_generic_code_names_no_family_comments_included():
    """A family is its package (models/<family>/): generic modules, comments and docstrings included, never name
    one, so adding a family touches its package and one registry line."""
    from vllm_omni.diffusion.models.registry import FAMILY_PACKAGES

    family_modules = tuple(f"vllm_omni.diffusion.models.{package}" for package in FAMILY_PACKAGES)
    offenders = [
        f"{name}:{number}: {line.strip()}"
        for name, path in MODULES.items()
        if not name.startswith(family_modules) and name not in NAMES_FAMILIES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FAMILY_NAMES.search(line)
    ]
    assert not offenders, "\n".join(offenders)
