"""`derive`: regenerate generated/, docs/ops/ and docs/layers/ from the op and block specs.

    derive                     regenerate everything, a progress line per op and layer
    derive --check             regenerate in memory; fail with a unified diff if anything differs
    derive --show NAME         print every stage of one op's derivation, or a layer's page
    derive --show              list the op and layer names
    derive my_op.py --out DIR  derive a spec written outside this repo: DIR/<op>.py (kernels,
                               autograd, API), DIR/<op>.md (derivation), DIR/test_<op>.py
    derive --show my_op.py     print every stage of that spec's derivation, writing nothing
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path

from codegen.driver.build import (
    LAYERS,
    OPS,
    ROOT,
    build_all,
    build_layer,
    build_op,
    build_user_op,
    layer_files,
    op_files,
)
from codegen.schedule import MissingTable
from derive.engine import load_spec
from derive.reverse import DerivationError
from derive.spec import SpecError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="derive", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="fail with a diff when generated/ or docs/ is out of date")
    parser.add_argument("--show", metavar="NAME", nargs="?", const="",
                        help="print every stage of one op (a name, or a spec file's path), or "
                             "a layer's page; without NAME, list the names")
    parser.add_argument("spec", nargs="?", type=Path, help="a spec file outside derive/ops/")
    parser.add_argument("--out", type=Path, help="where `derive SPEC` writes (required with SPEC)")
    args = parser.parse_args(argv)

    try:
        if args.spec is not None and args.show == "" and args.out is None:
            return show(str(args.spec))  # `derive my_op.py --show`
        if args.spec is not None:
            return user_op(parser, args.spec, args.out)
        if args.show is not None:
            return show(args.show)
        if not (ROOT / "pyproject.toml").is_file():
            parser.error(f"regenerating the shipped modules writes into a source checkout "
                         f"(pyproject.toml beside derive/), and {ROOT} is an installed copy; "
                         f"derive your own op with `derive SPEC --out DIR`")
        return regenerate(only_check=args.check)
    except (SpecError, DerivationError, MissingTable) as error:
        print(f"derive: error: {error}", file=sys.stderr)
        return 2


def user_op(parser: argparse.ArgumentParser, spec: Path, out: Path | None) -> int:
    if out is None:
        parser.error("derive SPEC needs --out DIR")
    if not spec.is_file():
        parser.error(f"argument spec: no such file: {spec}")
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {out} is a file; --out names a directory")
    files = _user_files(spec, out)
    out.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
        print(f"derive: wrote {path}")
    return 0


def _user_files(spec: Path, out: Path) -> dict[Path, str]:
    """What `derive SPEC --out DIR` writes; an engine failure is reported, not raised."""
    try:
        return build_user_op(spec, out)
    except (SpecError, DerivationError, MissingTable):
        raise
    except Exception as error:  # noqa: BLE001
        raise DerivationError(
            f"{spec}: the engine failed on this spec ({type(error).__name__}: {error}); the "
            "spec language is described in docs/spec_language.md. If the spec is within it, "
            "this is a bug of derive: please report it with the spec file.") from error


def regenerate(only_check: bool) -> int:
    start = time.perf_counter()
    files = build_all(progress=lambda line: print(line, flush=True))
    if only_check:
        return check(files)
    for relative, text in files.items():
        target = ROOT / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
    print(f"derive: wrote {len(files)} files in {time.perf_counter() - start:.2f} s")
    return 0


def check(files: dict[str, str]) -> int:
    stale = []
    for relative, text in files.items():
        target = ROOT / relative
        current = target.read_text() if target.exists() else ""
        if current != text:
            stale.append(relative)
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"a/{relative}", tofile=f"b/{relative}"))
    for directory in ("generated", "docs/ops", "docs/layers"):
        for path in sorted((ROOT / directory).glob("*.*")):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in files and path.suffix in (".py", ".md"):
                stale.append(relative)
                print(f"derive --check: {relative} is not produced by derive; remove it")
    if stale:
        print(f"derive --check: {len(stale)} file(s) out of date: {', '.join(stale)}; "
              "run `derive`")
        return 1
    print(f"derive --check: {len(files)} files up to date")
    return 0


def show(name: str) -> int:
    if name.endswith(".py") and Path(name).is_file():
        # a spec outside derive/ops/, by its path: the page `derive SPEC --out DIR` writes
        files = _user_files(Path(name), Path("DIR"))
        print(next(text for path, text in files.items() if path.suffix == ".md"))
        return 0
    path = OPS / f"{name}.py"
    layer = LAYERS / f"{name}.py"
    if not path.exists() and layer.exists() and not name.startswith("_"):
        specs = [load_spec(p, p.relative_to(ROOT).as_posix()) for p in op_files()]
        print(build_layer(layer, {spec.name: spec.api.function for spec in specs})[2])
        return 0
    if not name or not path.exists():
        names = [p.stem for p in op_files()] + [p.stem for p in layer_files()]
        if name:
            print(f"derive --show: no op or layer named '{name}' (nor a spec file of that "
                  "path)", file=sys.stderr)
        print(f"derive --show: available names: {', '.join(names)}",
              file=sys.stderr if name else sys.stdout)
        return 2 if name else 0
    derivation, _, page = build_op(path, path.relative_to(ROOT).as_posix())
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
