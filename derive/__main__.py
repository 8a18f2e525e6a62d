"""`derive`: regenerate generated/ and docs/ops/ from the op specs.

    derive                     regenerate everything, a progress line per op
    derive --check             regenerate in memory; fail with a unified diff if anything differs
    derive --show NAME         print every stage of one op's derivation
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time

from derive.build import OPS, ROOT, build_all, build_op


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="derive", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="fail with a diff when generated/ or docs/ops/ is out of date")
    parser.add_argument("--show", metavar="NAME", help="print every stage of one op")
    args = parser.parse_args(argv)

    if args.show:
        return show(args.show)
    start = time.perf_counter()
    files = build_all(progress=lambda line: print(line, flush=True))
    if args.check:
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
    for directory in ("generated", "docs/ops"):
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
    path = OPS / f"{name}.py"
    if not path.exists():
        print(f"derive --show: no spec {path.relative_to(ROOT)}", file=sys.stderr)
        return 2
    derivation, _, page = build_op(path, path.relative_to(ROOT).as_posix())
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
