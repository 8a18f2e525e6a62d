"""generated/ and docs/ops/ are exactly what `derive` writes, under any PYTHONHASHSEED."""

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from derive.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def test_derive_check_passes_on_the_checked_in_tree() -> None:
    assert main(["--check"]) == 0


def test_output_is_identical_under_different_hash_seeds(tmp_path: Path) -> None:
    script = ("import hashlib, derive.build as b; files = b.build_all();"
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
