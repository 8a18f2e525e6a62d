"""The hand-written runtime of the generated modules: what they import, and what puts them in a
user's model.

A generated module holds only what is specific to its op: its kernels, their launchers'
signatures, the autograd functions, the public API and the library registration. Everything they
share lives here, written and tested once, one module each:

- `amp`: torch's autocast policies, as the ops whose torch counterparts have one follow them;
- `blocks`: what the generated layers (`derive/layers/` block specs) share beyond the ops:
  splitting and merging attention heads, attention itself;
- `checks`: argument checks that raise torch's kinds of errors, naming the argument (the
  generated layers' too);
- `dispatch`: when a call runs torch's own expression of the op instead of the kernels (below
  the op's measured size, under `torch.compile`, `VJPFORGE_DISPATCH`);
- `hub`: the generated ops as layers of the `kernels` package, for transformers'
  `kernels.kernelize` (`kernel_mapping()`);
- `launch`: the host path shared by launchers (accumulator dtypes, row views, launch plans that
  skip Triton's per-call binding, column sums of per-program partials);
- `launcher`: each kernel's launcher, written and compiled at import from the declarative
  signature its module states (argument roles, stores, flags, fold, window and split); the
  forward of each memory mode and the op's forward `torch.library` op and its fake, from the
  forward's signature and what each mode keeps; each mode's backward `torch.library` op and its
  fake, from the mode's signature;
- `linear_loss`: a row loss of a linear layer's outputs computed chunk by chunk, so the logits
  never exist whole (`linear_cross_entropy`);
- `logits_route`: the training loss of masked and sequence-to-sequence LMs from the labelled
  rows' hidden states alone, through a linear loss (`patch_model(model, loss=True)`);
- `losses`: the helpers of per-row losses with a class target (torch's layout and legacy
  arguments, target and class-weight checks, the mean over the counted rows);
- `patch_loss`: `patch_model`'s "loss" kind: a Hugging Face LM's loss computed by a generated
  row loss, a causal LM's from the hidden states (`CausalLMRoute`), a masked LM's through
  `logits_route`;
- `patch_mlp`: `patch_model`'s "mlp" kind: a gated MLP, and the stacked experts of MoE layers,
  whose `act(gate) * up` a generated op computes;
- `patch_norm`: `patch_model`'s "norm" and "activation" kinds: modules found by class name,
  swapped for generated modules;
- `patch_residual`: `patch_model`'s "residual" kind: a transformer layer's residual add and the
  norm after it fused into one add + norm call;
- `patch_rotary`: `patch_model`'s "rotary" kind: an attention module's
  `apply_rotary_pos_emb` computed by the generated rotary op;
- `patching`: `patch_model()` itself: walks a model, asks each kind's plugin module above what
  its candidates become, and makes every swap (or none);
- `probe`: what proves a swap by behaviour: probe inputs, probe copies of a module, the
  comparison of outputs within a dtype's tolerance;
- `schedules`: how a kernel walks its rows (persistent, looped or split rows, warps, programs),
  chosen per call shape from the op's measured table and constants; `Schedules` is the one seam
  through which tests, `benchmarks.tune` and the benchmarks change a schedule;
- `swaps`: the vocabulary of a swap below the planner (`Rule`, `Swap`, `Skip`, swapped classes)
  and `PlanContext`, all a plugin module sees of a plan;
- `triton_helpers`: `@triton.jit` math helpers and their plain-torch twins.

This package imports neither sympy nor jinja: it is what runs in a user's process.
"""
