"""Every kernel the launchers call compiles for an H100 (sm_90) with the arguments they pass,
on any machine: tests/kernel_compile.py records the launches under Triton's interpreter, then
Triton's compiler lowers each to a cubin. The interpreter runs kernels that the compiler
refuses (a loop-carried value whose shape or type changes, for one)."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import triton

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).with_name("kernel_compile.py")


def _run(command: str, path: Path, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), command, str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True)


def test_every_launch_compiles_for_an_h100(tmp_path):
    launches = tmp_path / "launches.json"
    captured = _run("capture", launches, interpret=True)
    assert captured.returncode == 0, captured.stdout + captured.stderr
    recorded = json.loads(launches.read_text())
    # every kernel of every generated module is launched by some call
    seen = {(r["module"], r["kernel"]) for r in recorded}
    kernels = set()
    for path in sorted((ROOT / "generated").glob("*.py")):
        module = importlib.import_module(f"generated.{path.stem}")
        kernels |= {(module.__name__, name) for name, value in vars(module).items()
                    if isinstance(value, triton.runtime.jit.KernelInterface)
                    and value.fn.__module__ == module.__name__}
    assert kernels and kernels <= seen, sorted(kernels - seen)
    compiled = _run("compile", launches, interpret=False)
    assert compiled.returncode == 0, compiled.stdout[-20000:] + compiled.stderr[-5000:]
    assert f"{len(recorded)} of {len(recorded)} launches compiled" in compiled.stdout
