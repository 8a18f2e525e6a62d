"""Cross-entropy of logits over a large vocabulary, one loss per row, with optional class
weights w (1 where not given), as torch's:
loss = (1 - smoothing) * w[target] * nll + smoothing * mean_j(w_j * (logsumexp(x) - x_j)),
nll = logsumexp(x) - x[target], and 0 where target == ignore_index.

The smoothing term is computed as smoothing * (mean(w) * log(denominator) + mean_j(w_j *
(row_max - x_j))), with logsumexp(x) - x_j split at the row max m into log(denominator) and
the gap m - x_j: every term is >= 0 and exact, where a mean of the logits themselves would
round at their scale (logits 1e4 + N(0, 1): three digits of an O(1) loss), and a -inf logit
gives the term torch's +inf, never inf - inf. The row max is a stabiliser of logsumexp (the
engine proves the loss does not depend on it); the softmax is never stored: the backward
recomputes exp(x - row_max) / denominator from the saved logits and row statistics. The
weights get no gradient (torch gives them none either).

Three options of large-vocabulary training, all off by default (the kernels are then compiled
without them): `softcap` caps the logits first, z = softcap * tanh(x / softcap) (Gemma 2's
final logit softcapping), every term above then taken over z (the target's, from its one
gathered logit). `lse_square_scale` adds the z-loss, lse_square_scale *
logsumexp(z)^2, to each counted row's loss (PaLM's auxiliary loss, as Liger-Kernel's), its
logsumexp the one the loss already has: no further pass over the logits. `token_scaling`
multiplies a row's loss by its target's predicted probability to that power,
exp(token_scaling * (z[target] - logsumexp(z))), under `Detached`: the gradient does not flow
through the factor (Liger-Kernel's use_token_scaling at 1).
"""

import sympy

from derive.api import Option, Replaces, RowLossAPI
from derive.spec import Detached, N, OpSpec


def spec() -> OpSpec:
    op = OpSpec("cross_entropy", doc=__doc__)
    x = op.input("x")
    target = op.row_input("target", integer=True)
    weight = op.column_param("weight", absent=1, grad=False)
    ignore_index = op.scalar("ignore_index")
    smoothing = op.scalar("label_smoothing")
    z_scale = op.scalar("lse_square_scale", absent=0)
    softcap = op.scalar("softcap", absent=0)
    token_scaling = op.scalar("token_scaling", absent=0)
    key = op.column_index("key")
    # the capped logits; tanh saturates to ±1 (helpers.tanh), so they stay within ±softcap
    z = op.element("z", sympy.Piecewise((x, sympy.Eq(softcap, 0)),
                                        (softcap * sympy.tanh(x / softcap), True)))
    row_max = op.row_max("row_max", z)
    e = op.element("e", sympy.exp(z - row_max), positive=True)
    denominator = op.row_sum("denominator", e, positive=True)
    target_logit = op.row_sum("target_logit", sympy.Piecewise((z, sympy.Eq(key, target)),
                                                              (0, True)))
    target_weight = op.row_sum("target_weight", sympy.Piecewise((weight, sympy.Eq(key, target)),
                                                                (0, True)))
    weight_mean = op.row_mean("weight_mean", weight)
    # the logits' gaps below the row max, each >= 0 (+inf at a -inf logit)
    max_gap = op.row_mean("max_gap", weight * (row_max - z))
    # smoothing = 0 drops the term (a -inf logit is allowed, as in torch); an ignored row is
    # selected away, not multiplied by 0, so NaN logits there give a loss of 0, as in torch
    smoothed = op.row("smoothed", sympy.Piecewise((0, sympy.Eq(smoothing, 0)),
                                                  (smoothing * max_gap, True)))
    lse = sympy.log(denominator) + row_max
    # token scaling (Liger-Kernel's use_token_scaling at 1): the row's loss times its target's
    # predicted probability raised to token_scaling, exp(token_scaling * log p), the factor
    # never differentiated
    token_scale = op.row("token_scale", sympy.Piecewise(
        (1, sympy.Eq(token_scaling, 0)),
        (Detached(sympy.exp(token_scaling * (target_logit - lse))), True)))
    # the z-loss term alone, 0 in an ignored row (returned on request, for logging)
    z_loss = op.row("z_loss", sympy.Piecewise(
        (0, sympy.Eq(z_scale, 0) | sympy.Eq(target, ignore_index)),
        (z_scale * lse**2 * token_scale, True)))
    # the predicted class, torch.argmax's: the first column where the (capped) logits reach
    # their max, an index reduction never differentiated. N where none does (a row of -inf,
    # whose stabilised max 0 is no logit): class 0 then, as torch.argmax of -inf's
    first_max = op.row_min("first_max", sympy.Piecewise((key, z >= row_max), (N, True)))
    # -1 in an ignored row, as Liger-Kernel's
    predicted_tokens = op.row("predicted_tokens", sympy.Piecewise(
        (-1, sympy.Eq(target, ignore_index)), (0, sympy.Eq(first_max, N)), (first_max, True)))
    # 1 where a counted row's prediction is its target, else 0 (ignored rows too)
    token_accuracy = op.row("token_accuracy", sympy.Piecewise(
        (0, sympy.Eq(target, ignore_index)), (1, sympy.Eq(predicted_tokens, target)), (0, True)))
    # log(denominator)'s factor: exactly 1 without weights, whatever the smoothing
    factor = op.row("factor", target_weight + smoothing * (weight_mean - target_weight))
    # nll * (1 - smoothing) * w[target] + smoothing * mean_j(w_j * (logsumexp - z_j)), its
    # log(denominator) terms gathered: fewer roundings than the two sums added apart
    loss = op.row("loss", sympy.Piecewise(
        (0, sympy.Eq(target, ignore_index)),
        ((sympy.log(denominator) * factor
          + (1 - smoothing) * target_weight * (row_max - target_logit) + smoothed)
         * token_scale + z_loss, True)))
    op.output(loss)
    # returned on request (return_z_loss=True, ...), for logging
    op.output(z_loss, token_accuracy, predicted_tokens, grad=False)
    op.save(x, target, row_max, denominator, target_weight, weight_mean, target_logit)
    op.api = RowLossAPI(
        function="cross_entropy", module="CrossEntropyLoss",
        torch_function="torch.nn.functional.cross_entropy",
        target="target", ignore="ignore_index", weight="weight",
        options=(Option("ignore_index", -100, check="integer"),
                 Option("label_smoothing", 0.0, check="unit"),
                 Option("lse_square_scale", 0.0, check="finite", keyword_only=True, doc=(
                     "the z-loss (PaLM's, as Liger-Kernel's): each counted row adds "
                     "lse_square_scale * logsumexp(logits)^2 to its loss (of the capped logits "
                     "with softcap), which keeps the logits' normaliser near 1; its gradient is "
                     "derived with the rest. With class weights the mean divides it by the "
                     "counted rows' weight sum, as the rest of the loss, or by their count with "
                     "z_loss_mean=\"row_count\" (Liger-Kernel's definition). A finite number; 0 "
                     "turns it off.")),
                 Option("token_scaling", None, check="positive", keyword_only=True, doc=(
                     "token scaling: each row's loss (its z-loss too) is multiplied by its "
                     "target's predicted probability (of the capped logits with softcap) raised "
                     "to token_scaling, a factor the gradient does not flow through: 1.0 is "
                     "Liger-Kernel's use_token_scaling=True. A finite number > 0, or None "
                     "(off).")),
                 Option("softcap", None, check="positive", keyword_only=True, doc=(
                     "logit softcapping (Gemma 2's final logits): the logits become "
                     "softcap * tanh(input / softcap) before anything else, the gradient taken "
                     "through the tanh. A finite number > 0, or None (off)."))),
        count_means=(("lse_square_scale", "z_loss_mean"),),
        returns=("z_loss", "token_accuracy", "predicted_tokens"),
        returns_doc=(("z_loss", "the z-loss term alone, lse_square_scale * "
                                "logsumexp^2 per counted row (0 in ignored rows), for "
                                "logging, as Liger-Kernel's."),
                     ("token_accuracy", "the token accuracy, as Liger-Kernel's: 1 where a "
                                        "counted row's predicted class (return_predicted_tokens) "
                                        "is its target, else 0."),
                     ("predicted_tokens", "the predicted class of each counted row (-1 "
                                          "in ignored rows, as Liger-Kernel's), "
                                          "torch.argmax(logits, class dim): the first class of "
                                          "the row's largest logit, of the capped logits "
                                          "softcap * tanh(input / softcap) with softcap (tanh "
                                          "keeps the order: the class of the largest input, "
                                          "unless capping rounds the largest logits to one "
                                          "value; then the first of those), computed in float32 "
                                          "(float64 for float64 input). A row of -inf logits "
                                          "predicts class 0, as torch.argmax; a row holding NaN "
                                          "(whose loss is NaN) no class in particular, where "
                                          "torch.argmax takes the first NaN.")),
        returns_as=(("token_accuracy", "fraction"), ("predicted_tokens", "index")),
        # the loss of Hugging Face causal-LM models (GPT-2's is *LMHeadModel), masked LMs and
        # sequence-to-sequence LMs (T5's, whose forward takes the cross-entropy itself)
        replaces=(Replaces("*ForCausalLM", kind="loss"), Replaces("*LMHeadModel", kind="loss"),
                  Replaces("*ForMaskedLM", kind="loss"),
                  Replaces("*ForConditionalGeneration", kind="loss")))
    return op
