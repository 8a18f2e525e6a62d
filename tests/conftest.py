"""Test setup: run Triton kernels through the interpreter when there is no GPU, and the kernels
at every size.

TRITON_INTERPRET must be set before triton (and so the generated modules)
is imported: triton.jit decides at decoration time whether a kernel is
interpreted.  The test modules import the generated modules at collection,
after this file.
"""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# the tests are of the generated kernels: on a GPU, small CUDA tensors would otherwise run
# torch's expression of each op (codegen/runtime/dispatch.py); tests/test_dispatch.py tests that.
# Set before anything imports the runtime's dispatch, which reads it once.
os.environ["VJPFORGE_DISPATCH"] = "kernels"

from reference import (  # noqa: E402 - after the environment above
    PATHS,
    force_looped,
    force_split,
    select_path,
    splits,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from codegen.runtime.schedules import forget_all  # noqa: E402 - after TRITON_INTERPRET


@pytest.fixture(params=PATHS)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Device of a test's tensors; the test runs once per dispatch path."""
    return select_path(monkeypatch, request.param)


def _ops(test_module: object) -> tuple:
    modules = getattr(test_module, "OP", ())
    return modules if isinstance(modules, tuple) else (modules,)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The `schedule` fixture's schedules: whole rows, looped rows, looped rows with every
    other sweep run backwards (REVERSE), and where the test module's generated modules `OP`
    have kernels with a split form, split rows."""
    if "schedule" in metafunc.fixturenames:
        forms = ["persistent", "looped", "looped-reverse"]
        forms += ["split"] * any(splits(module) for module in _ops(metafunc.module))
        metafunc.parametrize("schedule", forms, indirect=True)


@pytest.fixture
def overrides() -> contextlib.ExitStack:
    """An ExitStack whose context managers (force_looped, force_split, any
    `SCHEDULES.override`) a test enters with `overrides.enter_context(...)`; they exit, last
    first, when the test ends, restoring each module's constants and forgetting its plans."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def schedule(request: pytest.FixtureRequest, overrides: contextlib.ExitStack) -> str:
    """Kernel schedule of the test module's generated module `OP`; runs once per schedule
    (pytest_generate_tests)."""
    for module in _ops(request.module) if request.param != "persistent" else ():
        if request.param == "split":
            overrides.enter_context(force_split(module))
        else:
            overrides.enter_context(force_looped(module, reverse=request.param == "looped-reverse"))
    return request.param


@pytest.fixture(autouse=True)
def forget_schedules():
    """After each test, every op forgets its schedules and launch plans (`forget_all`): a test
    that changed what a schedule depends on outside `SCHEDULES.override` (a device's refused
    split, a GPU's properties faked) leaves none behind for the next test's calls of the same
    shape, which a launch plan would otherwise launch."""
    yield
    forget_all()
