"""The math: the spec language (`spec`), the forward graph (`forward`, `graph`), reverse mode and
the backward written in saved values (`reverse`, `backward`, `algebra`, `canonical`, `stable`),
the recorded backward (`higher`) and the forward-mode derivative (`tangent`), tied together by
`engine`; `api` and `blocks` state what an op's or a layer's public interface takes. The specs
themselves are `ops/*.py` and `layers/*.py`.

Nothing here imports `codegen`: the compiler and the `derive` command (`codegen.driver`) sit on
top of this package.
"""
