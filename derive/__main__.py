"""`python -m derive`: the `derive` command (codegen/driver/command.py).

An entry point, imported by nothing: it sits above every layer, as the installed `derive`
script does, and the math package itself never imports the compiler or the driver."""

import sys

from codegen.driver.command import main

if __name__ == "__main__":
    sys.exit(main())
