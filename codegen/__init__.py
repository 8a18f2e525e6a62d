"""The compiler: a derived graph lowered to the kernel IR (`lower`, `ir`), fused sweeps (`fuse`),
schedules (`schedule`), the Triton and torch printers (`printers`) and the module writer
(`emit`, `layers`, `templates/`). Above it, `driver` (the `derive` command); beside it, `runtime`,
what the generated modules import at run time, which imports nothing of the compiler.
"""
