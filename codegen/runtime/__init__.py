"""The hand-written runtime that every generated module imports.

A generated module holds only what is specific to its op: its kernels, their launchers, the
autograd functions, the public API and the library registration. Everything they share lives
here, written and tested once:

- `schedules`: how a kernel walks its rows (persistent, looped or split rows, warps, programs),
  chosen per call shape from the op's measured table and constants; `Schedules` is the one seam
  through which tests, `benchmarks.tune` and the benchmarks change a schedule;
- `launch`: the host path shared by launchers (accumulator dtypes, launch plans that skip
  Triton's per-call binding, column sums of per-program partials);
- `triton_helpers`: `@triton.jit` math helpers and their plain-torch twins;
- `checks`: argument checks that raise torch's kinds of errors;
- `amp`: torch's autocast policies, as the ops whose counterparts have one follow them;
- `losses`: the helpers of per-row losses with a target.

This package imports neither sympy nor jinja: it is what runs in a user's process.
"""
