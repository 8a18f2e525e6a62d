"""generated/ and docs/ops/ are exactly what `derive` writes, under any PYTHONHASHSEED."""

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from codegen.driver.command import main

ROOT = Path(__file__).resolve().parent.parent


def test_derive_check_passes_on_the_checked_in_tree() -> None:
    assert main(["--check"]) == 0


def test_output_is_identical_under_different_hash_seeds(tmp_path: Path) -> None:
    script = ("import hashlib, codegen.driver.build as b; files = b.build_all();"
              "print(hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest())")
    digests = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                                capture_output=True, text=True, check=True)
        digests.add(result.stdout.strip())
    assert len(digests) == 1


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module imported, the line) of each top-level import statement of a file (parsed: a
    docstring line that starts with "from" is none)."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, ast.Import):
            found += [(alias.name, lines[node.lineno - 1]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", lines[node.lineno - 1]))
    return found


#: the layers, bottom up: what the generated modules run on, the math, the compiler, the driver
LAYERS = ("codegen.runtime", "derive", "codegen", "codegen.driver")


def test_python_m_derive_runs_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "derive", "--show"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0 and "layernorm" in result.stdout, result.stderr[-2000:]
    assert not any(line.startswith(("from", "import")) and "derive.__main__" in line
                   for path in [*ROOT.glob("derive/**/*.py"), *ROOT.glob("codegen/**/*.py")]
                   for line in path.read_text().splitlines())


def _layer(module: str) -> int | None:
    """The index in LAYERS of the deepest layer that holds `module`; None outside them."""
    found = [i for i, top in enumerate(LAYERS) if module == top or module.startswith(top + ".")]
    return max(found, key=lambda i: len(LAYERS[i])) if found else None


def test_imports_point_down_the_layers() -> None:
    """Every import in derive/ and codegen/, function-level ones included, reaches its own layer
    or one below: the driver imports the compiler and the math, the compiler the math, the math
    neither, the runtime only itself."""
    for path in sorted([*(ROOT / "derive").rglob("*.py"), *(ROOT / "codegen").rglob("*.py")]):
        if path.name == "__main__.py":
            # `python -m derive`: an entry point that nothing imports, above every layer
            assert path == ROOT / "derive" / "__main__.py", path
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        own = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # a relative import counts from the file's package
                base = own.split(".") if parts[-1] == "__init__" else own.split(".")[:-1]
                package = base[:len(base) - node.level + 1]
                names = [".".join([*package, node.module or ""]).strip(".")
                         if node.level else node.module or ""]
            else:
                continue
            for name in names:
                layer = _layer(name)
                assert layer is None or layer <= _layer(own), (
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name}, a layer above "
                    f"{LAYERS[_layer(own)]}")


def _runtime_import_graph() -> dict[str, set[str]]:
    """Each module of codegen/runtime and the runtime modules it imports, function-level
    imports included (`from codegen.runtime import a, b` imports a and b; a relative import
    counts from the package)."""
    runtime = ROOT / "codegen" / "runtime"
    modules = {path.stem for path in runtime.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for module in sorted(modules):
        found = set()
        for node in ast.walk(ast.parse((runtime / f"{module}.py").read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = "codegen.runtime" if node.level else ""
                package = ".".join(filter(None, [base, node.module or ""]))
                names = [package] + [f"{package}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                head, _, rest = name.partition("codegen.runtime.")
                target = rest.split(".")[0] if not head and rest else None
                if target in modules and target != module:
                    found.add(target)
        graph[module] = found
    return graph


def test_runtime_imports_form_no_cycle() -> None:
    """No runtime module imports, even inside a function, one that imports it back, directly
    or through others: each layer (the probe below the plugins, the plugins below the planner)
    can be read, tested and changed without the ones above it."""
    graph = _runtime_import_graph()
    assert graph.get("patching"), "no import of patching's was found: the walk reads nothing"
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            assert state.get(target) != 1, " -> ".join([*path, module, target])
            if target not in state:
                walk(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])


def test_generated_modules_import_only_torch_triton_and_the_runtime() -> None:
    # the standard library, torch and triton (patch.py imports the sibling modules), and the
    # hand-written runtime `codegen.runtime`, never the rest of codegen (sympy, jinja)
    allowed = {"collections", "fnmatch", "functools", "math", "numbers", "os", "struct",
               "typing", "torch", "triton"}
    for path in sorted((ROOT / "generated").glob("*.py")):
        for module, line in _imports(path):
            top = module.split(".")[0]
            runtime = module == "codegen.runtime" or module.startswith("codegen.runtime.")
            assert top in allowed | {"generated"} or runtime, f"{path.name}: {line}"
    # ... and the runtime imports only the standard library, torch, triton and itself
    standard = allowed | {"__future__", "contextlib", "copy", "dataclasses", "importlib",
                          "inspect", "itertools", "linecache", "sys", "threading", "types",
                          "weakref"}
    for path in sorted((ROOT / "codegen" / "runtime").glob("*.py")):
        for module, line in _imports(path):
            top = module.split(".")[0]
            runtime = module == "codegen.runtime" or module.startswith("codegen.runtime.")
            # hub.py hands the generated ops to the kernels package as its layers (as
            # generated/patch.py hands them to patching): no generated module imports it
            adapter = path.name == "hub.py" and top == "generated"
            assert top in standard or runtime or adapter, f"codegen/runtime/{path.name}: {line}"
    assert not any(module == "codegen.runtime.hub"
                   or (module == "codegen.runtime" and "hub" in line.split(" import ")[1])
                   for path in (ROOT / "generated").glob("*.py")
                   for module, line in _imports(path))
    assert hashlib  # the digest test above uses it through the subprocess script
