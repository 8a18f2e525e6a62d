"""The driver: the `derive` command (`command`), what it writes (`build`: every generated module,
page and user test as {path: text}) and the derivation pages (`pages`).

It sits on top: it reads the specs through the math (`derive`: specs, the symbolic derivation,
the VJP and JVP engines) and hands the results to the compiler (`codegen`: lowering to the
kernel IR, fusion, printers, the Jinja templates). The math imports neither, the compiler never
imports the driver, and the runtime (`codegen.runtime`) imports none of them.
"""
