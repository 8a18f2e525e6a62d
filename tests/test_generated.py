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


def _layer(module: str) -> int | None:
    """The index in LAYERS of the deepest layer that holds `module`; None outside them."""
    found = [i for i, top in enumerate(LAYERS) if module == top or module.startswith(top + ".")]
    return max(found, key=lambda i: len(LAYERS[i])) if found else None


def test_imports_point_down_the_layers() -> None:
    """Every import in derive/ and codegen/, function-level ones included, reaches its own layer
    or one below: the driver imports the compiler and the math, the compiler the math, the math
    neither, the runtime only itself."""
    for path in sorted([*(ROOT / "derive").rglob("*.py"), *(ROOT / "codegen").rglob("*.py")]):
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
