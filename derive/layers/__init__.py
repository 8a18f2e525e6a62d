"""Block specs: whole transformer layers composed of generated ops (see derive/blocks.py).

Each public file defines `block() -> BlockSpec`; `derive` emits generated/<name>.py and
docs/layers/<name>.md from it. Files starting with `_` hold pieces the specs share.
"""
