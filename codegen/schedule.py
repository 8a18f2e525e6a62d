"""Schedules: HOW a kernel walks its rows, kept apart from WHAT it computes.

The generated module gets these numbers as constants and a small run-time heuristic that
picks, per (M, N): persistent rows (whole row in registers, several rows per program for small
N) or looped rows (one sweep per reduction pass), the warps, and — for kernels that produce
column partials — a grid that scales with the SM count instead of one program per row block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

#: written by `python -m benchmarks.tune --out DIR --write-table` from measurements on a GPU
MEASURED_TABLE = Path(__file__).with_name("schedule_table.json")


def load_measured(path: Path = MEASURED_TABLE) -> dict:
    """The measured table: per op, per kernel kind ("fwd", "bwd") and row width (a power
    of two, or a padded width measured as itself and used only there),
    [rows, warps, programs per SM (0: one program per row block), software-pipeline stages,
    columns per step of a looped row (0 or absent: whole rows), for a looped row with a joined
    sweep whether one sweep (1) or a pass each (0) was the faster (absent or -1: the rule
    decides), the kernel form measured faster (bit 1: no masks where the row blocks tile, bit
    2: the row-block loop kept with one program per row block, bit 4: every other sweep of a
    looped row run backwards, bit 8: whole rows compiled to the register budget of an SM's
    programs, bit 16: whole rows compiled for their width; absent: 1)],
    the fastest measured; under "<kind>_looped" the fastest looped one, for rows that may not be
    whole; "<kind>_fp32" and "<kind>_fp32_looped" as measured on fp32 tensors."""
    return json.loads(path.read_text()) if path.exists() else {"ops": {}, "borrow": {}}


@dataclass(frozen=True)
class ScheduleTable:
    """The measured per-op table (codegen/schedule_table.json, `benchmarks/tune.py`) picks rows,
    warps, programs and pipeline stages wherever it has the op and the row width; the constants
    below decide the rest (looped rows, widths and ops it lacks). They too were measured:
    `python -m benchmarks.sweep` on an H100 (torch 2.11, triton 3.6, bf16,
    2026-11-21) over 4096x512 ... 1024x262144. One program per SM beat four for every
    norm backward (32768x256: 916 vs 239 GB/s; 4096x4096: 1366 vs 980), and 256 elements
    per warp beat 1024 from 4096 columns up. See docs/benchmarks.md.
    Looped rows (`python -m benchmarks.sweep --large`, same machine and day): 2 rows x 4096
    columns per step for kernels with column partials beat 1 x 4096 and 4 x 1024 (mean-and-
    variance norm bwd 4096x32768: 783 vs 543 and 273 GB/s; RMS norm: 1174 vs 465); forwards are
    flat in it."""

    #: rows whose next power of two is at most this keep the whole row in registers
    persistent_max_block_n: int = 16384
    #: kernels with column partials loop over rows wider than this many bytes: measured on the
    #: H100 (benchmarks.run, 2026-11-21), fp32 layer-norm backward 4096x16384 persistent ran at
    #: 366 GB/s (registers spilled at 16 warps) against 1260 GB/s looped at 4096x32768
    persistent_max_partial_row_bytes: int = 32768
    #: ... and loop over padded rows (N between powers of two) from this block width:
    #: `python -m benchmarks.sweep --wide` on the H100 (2026-11-22, bf16), backward 4096x12288
    #: looped against whole rows of 16384: layer norm 1433 vs 1155 GB/s, RMS norm 1795 vs 1629
    #: (at exactly 4096x16384 whole rows stay: layer norm 1356 vs 1287 looped)
    padded_partial_looped_block_n: int = 16384
    #: backward kernels without column partials keep whole rows of up to this many bytes past
    #: persistent_max_block_n; 0 here, raised per op in `per_op` where measured
    persistent_max_bwd_row_bytes: int = 0
    #: ... and forward kernels likewise (0 here, raised per op in `per_op` where measured)
    persistent_max_fwd_row_bytes: int = 0
    #: forward kernels loop over rows wider than this (persistent_max_block_n here, lowered per
    #: op in `per_op` where measured)
    persistent_max_fwd_block_n: int = 16384
    #: ... and backward kernels likewise
    persistent_max_bwd_block_n: int = 16384
    #: elementwise-only kernels (no reductions, nothing per row or column) read contiguous rows
    #: whose width is not a multiple of this as rows of this width, where the tensor tiles into
    #: them (0: never)
    fold_block_n: int = 0
    #: software-pipeline stages of a looped row's column sweeps: `python -m benchmarks.sweep
    #: --large` on the H100 (2026-11-21, bf16): 3 stages beat 1 at 4096x32768 (layer-norm
    #: backward 966 vs 812 GB/s, forward 2382 vs 2016; RMS norm backward 1343 vs 1124; softmax
    #: forward 2483 vs 2199). Wider elements fall back to 1 where the buffers would not fit
    #: (fp32 layer-norm backward, 2 x 4096 a step: 320 KiB asked for, 227 KiB there)
    looped_stages: int = 3
    #: looped rows of at least this many columns carry two dependent reductions in one sweep
    #: (codegen/fuse.py: a variance with its mean, a sum of exponentials with its max); shorter
    #: rows are re-read from L2 cheaply and keep a pass each, which needs less arithmetic.
    #: `benchmarks.tune --looped --modes fwd` (H100, bf16, 2026-11-22), fastest one sweep vs a
    #: pass each: layer norm 4096x32768 2572 vs 2644 GB/s, 4096x65536 2141 vs 1569, 1024x262144
    #: 1919 vs 1464; softmax 2184 vs 2554, 2061 vs 1819, 1835 vs 1476. fp32 rows of 32768 (as
    #: many bytes as bf16 65536) lost with one sweep in benchmarks.run (layer norm 1996 vs 2168,
    #: softmax 2456 vs 2644 the grid before): a column count, not bytes
    one_sweep_min_n: int = 65536
    #: a looped row's sweeps read its elements again: where a row of one tensor is at most this
    #: many bytes, the reads before the last load them `evict_last` (kept in L2 for the next
    #: sweep) and the last `evict_first`; longer rows keep the default. `benchmarks.counters`
    #: (H100, bf16, 2026-11-22), without hints -> with: softmax backward 4096x65536 2037 ->
    #: 2735 GB/s (DRAM bytes 1.45x -> 1.09x the model), softmax forward 4096x65536 2539 ->
    #: 2766, RMS-norm forward 4096x32768 2770 -> 2925; fp32 rows of 256 KiB (4096x65536):
    #: layer-norm forward 2029 -> 2444 (DRAM 1.47x -> 1.13x), softmax forward 2050 -> 2732,
    #: softmax backward 1840 -> 1945; rows of 512 KiB gained nothing (1024x262144 bf16: the
    #: rows in flight overflow L2 either way), its layer-norm backward lost (1435 -> 1365)
    keep_max_row_bytes: int = 262144
    #: elements per step of a looped row (split over its rows)
    looped_block_n: int = 8192
    #: backward kernels walk their row blocks from the last to the first (1) or from the first
    #: (0): a backward's inputs were last touched in row order (the forward just before it, or
    #: whatever wrote the output gradient: the next op's backward, a matmul's tiles), so their
    #: last rows are the likeliest still in L2
    backward_last_first: int = 1
    #: rows per step of a looped kernel that accumulates column partials: each step's
    #: read-modify-write of the fp32 partials (8 bytes a column per partial) is shared by them
    looped_grid_stride_rows: int = 2
    #: kernels with column partials and row reductions (norm backwards) split rows of at least
    #: this many columns over a group of programs that run at once (0: never; per op in
    #: `per_op`, where measured): each program keeps a slab of SPLIT_BLOCK_N columns of a row
    #: and its column partials in registers, and the group's programs exchange their slabs'
    #: partial row sums, so every element is read once where a looped row reads it twice
    #: (and again its partials each step)
    split_min_n: int = 0
    #: ... and of at least this many bytes
    split_min_row_bytes: int = 0
    #: ... and of at most this many bytes (0: no bound)
    split_max_row_bytes: int = 0
    #: backward kernels with row reductions but no column partials (a softmax backward) split
    #: rows of at least this many bytes (0: never)
    split_other_min_row_bytes: int = 0
    #: columns of a program's slab, widened where a row would need more than
    #: split_max_members programs
    split_block_n: int = 4096
    split_max_members: int = 32
    #: slab columns an SM holds: SPLIT_SM_ELEMENTS // slab programs an SM
    split_sm_elements: int = 8192
    split_elements_per_thread: int = 16
    #: rows a program takes a step (each step one exchange per pass)
    split_rows: int = 1
    #: 1: the three split counts above (slab columns, columns an SM, elements a thread) are of
    #: 2-byte elements, and wider elements take as many bytes, fewer columns (0: columns)
    split_by_bytes: int = 0
    #: target elements per program step when N is small (several rows per program)
    row_block_elements: int = 8192
    #: ... and for forward kernels, where it differs (0: row_block_elements; per op in `per_op`)
    fwd_row_block_elements: int = 0
    max_rows: int = 64
    #: grid-stride kernels (those with column partials) launch this many programs per SM
    programs_per_sm: int = 1
    #: programs when no GPU is there to count SMs (the Triton interpreter)
    interpreter_programs: int = 4
    min_warps: int = 4
    max_warps: int = 16
    elements_per_warp: int = 256
    #: most shared memory a software pipeline may claim for its buffered loads (the H100 gives
    #: a program up to 227 KiB; the reductions need some too)
    pipeline_shared_bytes: int = 160 * 1024
    #: the column sums of the partials: one program sums BLOCK_C columns over BLOCK_P
    #: partial rows at a time
    column_sum_block_p: int = 256
    column_sum_block_c: int = 32
    #: the same under the Triton interpreter, which runs its programs one after another: few
    #: wide ones (a 262144-column sum: 64 programs instead of 8192)
    interpreter_column_sum_block_c: int = 4096

    #: constants above that differ per op, each from a measurement. softmax backward whole
    #: rows up to 64 KiB (bf16 32768), same sweep: 4096x32768 2804 vs 1962 GB/s looped,
    #: 2048x24576 2684 vs 2219; 65536 (128 KiB) whole collapsed to 444. Not for cross-entropy:
    #: its backward at 4096x32000 whole ran 2x slower than looped (benchmarks.transformer_ops,
    #: same day); forwards lose too (layer-norm forward 4096x32768 whole: 1096 vs 2392 looped)
    per_op: dict = field(default_factory=lambda: {
        # norm backwards split rows of 12288 columns and more (layer norm) and of 64 KiB and
        # more (RMS norm: whole rows of 16384 bf16 columns stay). A probe of the split kernel
        # (H100, bf16, 2026-11-22; slabs of 2048-8192 columns, 1 or 2 rows a step, 8 or 16
        # warps, 1 or 2 programs an SM, the next row block's loads issued before the exchange
        # or not) found one row a step with the loads issued first fastest everywhere, and
        # slabs of 4096 columns at 8 warps, 2 programs an SM for layer norm (8192 at 16 warps
        # for 1024x262144), 8192 at 8 warps, 1 an SM for RMS norm: the constants here. With
        # them, `python -m benchmarks.split --shapes 4096x12288,4096x16384,4096x32768,
        # 1024x262144 --ops layernorm,rmsnorm` (H100, same day), split vs whole or looped GB/s:
        # layer norm bf16 1966 vs 1551, 1986 vs 1523, 2304 vs 1484, 1817 vs 1422; fp32 2246 vs
        # 1755, 2158 vs 1595, 2560 vs 1587, 2402 vs 1604; RMS norm bf16 1730 vs 2228, 2003 vs
        # 2262, 2085 vs 1602, 1923 vs 1583; fp32 2125 vs 2332, 2294 vs 2026, 2553 vs 1714, 2525
        # vs 1685. Layer norm at 4096x8192 and 16384x5120 (whole rows) lost split (a probe: bf16
        # 1750 vs 2536, 1618 vs 2522)
        "layernorm": {"split_min_n": 12288},
        "rmsnorm": {"split_min_n": 1, "split_min_row_bytes": 65536, "split_block_n": 8192,
                    "split_elements_per_thread": 32},
        # the residual-add norms' backwards (4 activation-sized tensors: the gradients of the
        # output and of the residual stream, the residual stream, the input gradient):
        # `python -m benchmarks.split --shapes 4096x8192,4096x12288,4096x16384,4096x32768,
        # 1024x262144 --ops add_layernorm,add_rmsnorm` (H100, 2026-11-22), split vs whole or
        # looped GB/s: add_layernorm bf16 1858 vs 2515, 2298 vs 1718, 2180 vs 1502, 2608 vs
        # 1507, 2239 vs 1555; fp32 1711 vs 2781, 1922 vs 1929, 1826 vs 1742, 2001 vs 1765, 1619
        # vs 1815 (rows of 1 MiB: bounded). add_rmsnorm at rmsnorm's slabs (8192 columns, 32
        # elements a thread) bf16 1920 vs 2573, 2020 vs 2452, 2170 vs 1889, 2280 vs 1765, 2298
        # vs 1733; fp32 1900 vs 2789, 1939 vs 2423, 2045 vs 2164 (16384 columns: fp32 loses 6%
        # where bf16 gains 15%; the rule counts columns), 2211 vs 1903, 1782 vs 1911 (bounded)
        "add_layernorm": {"split_min_n": 12288, "split_max_row_bytes": 524288},
        "add_rmsnorm": {"split_min_n": 16384, "split_max_row_bytes": 524288,
                        "split_block_n": 8192, "split_elements_per_thread": 32},
        # the masked softmax's backward walks its rows from the first: from the last it ran 7%
        # slower (H100, bf16, 2026-11-22, forward+backward with a (B, 1, 1, S) mask, interleaved
        # rounds: 1x32x4096x4096 2643 GB/s against 2848, 1x16x4096x4096 2619 against 2829,
        # with or without dropout), where the plain softmax at the same rows (131072x4096) ran
        # 3051 against 3045
        "masked_softmax": {"backward_last_first": 0},
        "softmax": {"persistent_max_bwd_row_bytes": 65536,
                    # the backward splits rows of 256 KiB and more: `python -m benchmarks.split
                    # --shapes 2048x128256,4096x65536,1024x262144 --ops softmax` (H100,
                    # 2026-11-22), split vs whole or looped GB/s: fp32 2763 vs 1893, 2753 vs
                    # 2157, 2391 vs 1832; bf16 2118 vs 2213, 2278 vs 2824, 2030 vs 1890
                    "split_other_min_row_bytes": 262144,
                    # forward: `benchmarks.tune --modes fwd --shapes 4096x32768` (H100, bf16,
                    # 2026-11-22): whole rows at 32 warps 2789 GB/s against 2559 looped
                    "persistent_max_fwd_row_bytes": 65536,
                    # one sweep only past 65536 columns: `tune --looped --modes fwd` (H100,
                    # bf16, 2026-11-22, twice), fastest one sweep vs a pass each at 4096x65536:
                    # 2336 vs 2426 GB/s, then 2410 vs 2551 (code 3fa0361); at 1024x262144 1913
                    # vs 1464. Its output sweep re-reads the row, so the statistics sweep's
                    # second read is the only one saved, and a 128 KiB row is still in L2.
                    # benchmarks.run at 2048x128256 (one sweep, code 1453802 / a pass each,
                    # 9954f72): bf16 1718 / 1601 GB/s, fp32 1973 / 1505
                    "one_sweep_min_n": 65537},
        # elementwise forwards whose activation is costly loop over 4096 columns a step instead
        # of whole rows: more programs an SM hide its latency (H100, bf16, 2026-11-22, a probe
        # forcing the schedule: GELU forward 8192x16384 271 us whole at 16 warps, 237 at 32,
        # 196 looped at 4096 and 8 warps, against torch.compile's 216; GeGLU 4096x11008 139,
        # 106, 98, torch.compile 95). With this rule (16 warps, 3 stages), `benchmarks.
        # transformer_ops` before/after the same day: GELU 8192x16384 0.271 -> 0.212 ms, GeGLU
        # 4096x11008 0.139 -> 0.100 and 8192x14336 0.290 -> 0.240, tanh GELU 8192x16384 0.191
        # -> 0.186, SwiGLU 4096x11008 0.100 -> 0.096 and 8192x14336 0.236 -> 0.240
        # their backwards, whose one column partial (the bias gradient) is a small share of a
        # step's traffic, loop one row a step: H100, 2026-11-22, a probe forcing the constants
        # (rows a step 1, 2, 4; 2048-8192 columns; 8 or 16 warps; 1 or 2 programs an SM; whole
        # rows up to 32 or 64 KiB), GELU backward fp32 8192x16384 2485 GB/s at 2 rows x 4096
        # columns, 2675 at 1 row x 4096 (16 warps); bf16 (whole rows of 32 KiB) 2260-2263 in
        # every configuration
        # ... and from 4096 columns they split rows into column slabs (no row reductions: no
        # exchange; each program keeps its slab's bias-gradient partials in registers over its
        # rows, where a looped row reads, adds to and writes back its program's partial row
        # each step): 4 KiB of a row a program (bf16 2048 columns, fp32 1024), 16 bytes a
        # thread, 4 programs an SM. H100, 2026-11-22, a probe of the public backward with the
        # split constants forced (slabs of 256-2048 columns, 2-8 elements a thread, 4-16
        # programs an SM), GB/s unsplit -> these: GELU bf16 4096x4096 1847 -> 2071, 8192x8192
        # 2299 -> 2528, 8192x16384 2206 -> 2649, 4096x32768 1626 -> 2642, 4096x11008 1075 ->
        # 2176; fp32 2453 -> 2529, 2774 -> 2828, 2555 -> 2867, 1905 -> 2881, 2225 -> 2787; tanh
        # GELU bf16 1827 -> 2102, 2214 -> 2705, 2773 -> 2820, 1873 -> 2820, 1277 -> 2502; fp32
        # 2463 -> 2496, 2845 -> 2820, 2614 -> 2860, 2034 -> 2872, 2480 -> 2785
        # GELU's forward steps run at 8 warps (512 elements a warp): H100, 2026-11-22,
        # interleaved rounds of the public forward against torch.compile with the constants
        # forced, GB/s at 16 -> 8 warps a 4096-column step: bf16 8192x16384 2510 -> 2635
        # (torch.compile 2485), fp32 2927 -> 2928 (2979); 4096x4096 bf16 2129 -> 2126, fp32
        # 2645 -> 2633 (its 2 rows of 4096 a program). Steps of 2048 at 4 warps: bf16 2661, fp32
        # 2877 (lost). Whole-row programs of 8192 elements (2 rows of 4096, 8 of 1024) keep 16
        # warps (capped at MAX_WARPS); the split backwards (from 4096 columns) count their own
        **{op: {"persistent_max_fwd_block_n": 4096, "looped_grid_stride_rows": 1,
                "split_min_n": 4096, "split_block_n": 2048, "split_sm_elements": 8192,
                "split_elements_per_thread": 8, "split_by_bytes": 1, **own}
           for op, own in (("gelu", {"elements_per_warp": 512}), ("gelu_tanh", {}))},
        # ... and so do the GLU backwards (no reductions either way): H100, bf16, 2026-11-22, a
        # probe forcing the constants (whole rows, or looped at 2048-8192 columns, 1 or 3
        # stages, 4-16 warps), backward whole rows (16 warps) against looped at 4096 columns,
        # 3 stages, 16 warps: GeGLU 4096x11008 2069 vs 2838 GB/s, 8192x14336 2358 vs 2955;
        # SwiGLU 4096x11008 2670 vs 2869, 8192x14336 2974 vs 2977 (the fastest: 8192 columns,
        # 8 warps, 2876 and 2981). GeGLU's erf is evaluated once since the same day's
        # lowering shares subexpressions of the epilogue's definitions with its outputs.
        # GLU kernels (elementwise only) also read contiguous rows of 11008 or 14336 as rows of
        # 4096, one a program: a probe forcing FOLD_BLOCK_N (0, 1024-8192), ROW_BLOCK_ELEMENTS
        # (4096-16384) and MAX_WARPS (8, 16), H100, bf16, 2026-11-22, fwd / bwd GB/s without the
        # fold -> folded at 4096 with 4096 elements a program (16 warps): GeGLU 4096x11008
        # 2726 / 2844 -> 2805 / 2937, 8192x14336 2935 / 2956 -> 2966 / 3019; SwiGLU 4096x11008
        # 2788 / 2876 -> 2859 / 2911, 8192x14336 2930 / 2938 -> 2993 / 3001. GeGLU's backward
        # at 8192 elements a program (2 rows of 4096) ran 2359 and 2434
        **{op: {"persistent_max_fwd_block_n": 4096, "persistent_max_bwd_block_n": 4096,
                "fold_block_n": 4096, "row_block_elements": 4096}
           for op in ("swiglu", "geglu")},
        # the bias-dropout-add forward takes 4096 elements a program (whole rows of up to 4096
        # columns: 4 rows of 1024, 16 warps), its backward 8192 (the bias-gradient partials
        # shared by 2 rows of 4096). H100, 2026-11-22, interleaved rounds of the public call
        # against torch.compile with the constants forced (ROW_BLOCK_ELEMENTS 1024-8192,
        # ELEMENTS_PER_WARP 128, 256), GB/s at 8192 -> 4096 elements a program: forward fp32
        # 4096x1024 1706 -> 1898 (torch.compile 1812), bf16 1412 -> 1435, fp32 16384x4096 2935
        # -> 2950, bf16 2849 -> 2857, 8192x8192 equal; forward+backward at 4096 lost 3% at bf16
        # 16384x4096 (2473 -> 2396) and 1-2% at 4096x1024 bf16, hence forwards only
        "bias_dropout_add": {"fwd_row_block_elements": 4096},
    })

    #: measured per-op schedules (see load_measured); the constants above are the fallback
    #: for widths and ops the table does not cover
    measured_table: dict = field(default_factory=load_measured, compare=False, repr=False)

    def measured(self, op: str) -> list[tuple[str, int, tuple[int, ...]]]:
        """(kind, block_n, (rows, warps, programs per SM, stages, columns per looped step, one
        sweep, form)) of one op, sorted; an op listed under "borrow" uses the measurements of
        the op it names where it has none of its own (per kind and width). Entries of four
        numbers (whole rows, from before looped rows were measured) get a 0 step; entries
        without the sweep form measured (five numbers, or whole rows) get -1: the module's
        one-sweep rule decides; entries without a kernel form measured (`benchmarks.tune
        --forms`) get 1: masks dropped where the blocks tile, the row-block loop only where
        programs step over several row blocks."""
        ops = self.measured_table["ops"]
        entries = {}
        for source in (self.measured_table["borrow"].get(op), op):
            for kind, by_width in ops.get(source, {}).items():
                entries.update({(kind, int(block_n)): config
                                for block_n, config in by_width.items()})
        defaults = (0, 0, 0, 0, 0, -1, 1)
        return sorted((kind, block_n, (*config, *defaults[len(config):]))
                      for (kind, block_n), config in entries.items())

    def constants(self, op: str) -> dict[str, int]:
        """The module constants of one op: the fields above, with the op's `per_op` values."""
        if self.per_op.get(op):
            return replace(self, per_op={}, **self.per_op[op]).constants(op)
        return {
            "PERSISTENT_MAX_BLOCK_N": self.persistent_max_block_n,
            "PERSISTENT_MAX_PARTIAL_ROW_BYTES": self.persistent_max_partial_row_bytes,
            "PADDED_PARTIAL_LOOPED_BLOCK_N": self.padded_partial_looped_block_n,
            "PERSISTENT_MAX_BWD_ROW_BYTES": self.persistent_max_bwd_row_bytes,
            "PERSISTENT_MAX_FWD_ROW_BYTES": self.persistent_max_fwd_row_bytes,
            "PERSISTENT_MAX_FWD_BLOCK_N": self.persistent_max_fwd_block_n,
            "PERSISTENT_MAX_BWD_BLOCK_N": self.persistent_max_bwd_block_n,
            "FOLD_BLOCK_N": self.fold_block_n,
            "SPLIT_MIN_N": self.split_min_n,
            "SPLIT_MIN_ROW_BYTES": self.split_min_row_bytes,
            "SPLIT_MAX_ROW_BYTES": self.split_max_row_bytes,
            "SPLIT_OTHER_MIN_ROW_BYTES": self.split_other_min_row_bytes,
            "SPLIT_BLOCK_N": self.split_block_n,
            "SPLIT_MAX_MEMBERS": self.split_max_members,
            "SPLIT_SM_ELEMENTS": self.split_sm_elements,
            "SPLIT_ELEMENTS_PER_THREAD": self.split_elements_per_thread,
            "SPLIT_ROWS": self.split_rows,
            "SPLIT_BY_BYTES": self.split_by_bytes,
            "LOOPED_STAGES": self.looped_stages,
            "LOOPED_BLOCK_N": self.looped_block_n,
            "ONE_SWEEP_MIN_N": self.one_sweep_min_n,
            "KEEP_MAX_ROW_BYTES": self.keep_max_row_bytes,
            "LOOPED_GRID_STRIDE_ROWS": self.looped_grid_stride_rows,
            "BACKWARD_LAST_FIRST": self.backward_last_first,
            "ROW_BLOCK_ELEMENTS": self.row_block_elements,
            "FWD_ROW_BLOCK_ELEMENTS": self.fwd_row_block_elements,
            "MAX_ROWS": self.max_rows,
            "PROGRAMS_PER_SM": self.programs_per_sm,
            "INTERPRETER_PROGRAMS": self.interpreter_programs,
            "MIN_WARPS": self.min_warps,
            "MAX_WARPS": self.max_warps,
            "ELEMENTS_PER_WARP": self.elements_per_warp,
            "PIPELINE_SHARED_BYTES": self.pipeline_shared_bytes,
            "COLUMN_SUM_BLOCK_P": self.column_sum_block_p,
            "COLUMN_SUM_BLOCK_C": self.column_sum_block_c,
            "INTERPRETER_COLUMN_SUM_BLOCK_C": self.interpreter_column_sum_block_c,
        }


DEFAULT = ScheduleTable()
