"""What an install holds and how it behaves outside a checkout. The whole check (a wheel built
from the sdist, installed into a fresh venv and used from another directory) is .ci/wheel; these
are its fast parts, run with the suite."""

import ast
import importlib
import importlib.metadata
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import codegen.schedule
import generated
import vjpforge
from codegen.driver import command

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_and_data_file_of_the_tree_is_packaged() -> None:
    setuptools = PROJECT["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    # every folder of the three trees that holds a file (templates hold no __init__.py)
    on_disk = {path.parent.relative_to(ROOT).as_posix().replace("/", ".")
               for top in ("derive", "codegen", "generated")
               for path in (ROOT / top).rglob("*")
               if path.is_file() and "__pycache__" not in path.parts}
    assert listed == on_disk, f"unlisted: {on_disk - listed}; listed, absent: {listed - on_disk}"
    assert setuptools["py-modules"] == ["vjpforge"]
    data = setuptools.get("package-data", {})
    # every file beside the code that the compiler reads must ship
    for package in sorted(on_disk):
        directory = ROOT / package.replace(".", "/")
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                patterns = data.get(package, [])
                assert any(path.match(pattern) for pattern in patterns), \
                    f"{path.relative_to(ROOT)} is not in [tool.setuptools.package-data]"
    assert (ROOT / "LICENSE").is_file() and PROJECT["project"]["license-files"] == ["LICENSE"]


def test_vjpforge_exports_every_public_name_of_every_generated_module() -> None:
    wanted = {}
    for info in pkgutil.iter_modules(generated.__path__):
        source = (ROOT / "generated" / f"{info.name}.py").read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                wanted[node.name] = info.name
    assert sorted(vjpforge.__all__) == sorted(["__version__", *wanted])
    for name, module in wanted.items():
        assert getattr(vjpforge, name) is getattr(
            importlib.import_module(f"generated.{module}"), name)
    try:
        version = importlib.metadata.version("vjpforge")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
        version = "unknown"
    assert vjpforge.__version__ == version
    with pytest.raises(AttributeError, match="no attribute 'layernorm'"):
        vjpforge.layernorm  # noqa: B018 (a module, not an export)


def test_a_missing_schedule_table_stops_derive(tmp_path: Path, monkeypatch, capsys) -> None:
    missing = tmp_path / "schedule_table.json"
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", missing)
    monkeypatch.setattr(codegen.schedule, "_DEFAULT", [])
    with pytest.raises(codegen.schedule.MissingTable, match="schedule table .* is missing"):
        codegen.schedule.load_measured()
    assert command.main(["--check"]) == 2
    assert f"derive: error: the measured schedule table {missing} is missing" in \
        capsys.readouterr().err


def test_regenerating_an_installed_copy_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(command, "ROOT", tmp_path)  # no pyproject.toml: an installed copy
    for argv in ([], ["--check"]):
        with pytest.raises(SystemExit) as stopped:
            command.main(argv)
        assert stopped.value.code == 2
        assert "is an installed copy; derive your own op with `derive SPEC --out DIR`" in \
            capsys.readouterr().err


def test_the_readme_gives_every_module_constructor_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in vjpforge.__all__:
        cls = getattr(vjpforge, name)
        if inspect.isclass(cls):
            own = cls.__init__ is not torch.nn.Module.__init__
            call = f"{name}{inspect.signature(cls) if own else '()'}"
            assert f"| `{call}` |" in readme, f"README.md lacks the row | `{call}` |"
