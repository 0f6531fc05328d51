"""Curated mutants: deliberate bugs in what mixprec adds, each of which the default suite must catch.

Each mutant replaces one piece of source text with a wrong one (the replaced text must be found,
or the mutant is reported stale) in a copy of the repository, and runs the default-suite test
files that cover it (``-m "not slow" -x``). A mutant is killed when those tests fail. Exit status 1
if any survives or is stale.

    python tools/mutants.py              # every mutant (a few minutes)
    python tools/mutants.py --list       # the list
    python tools/mutants.py scaler-never-skips promote-no-op
    python tools/mutants.py --without tests/layers/test_layer_plan.py::test_x   # which only that test kills
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


S = "src/mixprec/_src/"  # where the modules live

# The test files that cover each area (tests/<room>/ mirrors src/mixprec/_src/<room>/).
SCALER_TESTS = (
    "tests/scaling/test_scaler.py",
    "tests/scaling/test_loss_scale.py",
    "tests/scaling/test_scaler_events.py",
    "tests/scaling/test_fail_fast.py",
    "tests/scaling/test_scaler_settings.py",
)
PREPARE_TESTS = (
    "tests/prepare/test_master_weights.py",
    "tests/step/test_stochastic_rounding.py",
    "tests/prepare/test_prepare_config.py",
)
POLICY_TESTS = ("tests/policy/test_policy.py", "tests/policy/test_policy_grammar.py")
AUTOCAST_TESTS = ("tests/amp/test_autocast.py", "tests/amp/test_module_rules.py")
LAYER_TESTS = ("tests/layers/test_guard.py", "tests/layers/test_layer_precision.py", "tests/layers/test_layer_plan.py")
COMPILE_TESTS = ("tests/test_compiled_training.py",)
FUSED_CAST_TESTS = ("tests/fp8/test_fused_cast.py",)
FP8_TESTS = ("tests/fp8/test_fp8_gemm.py", "tests/fp8/test_fp8_linear.py", "tests/fp8/test_fp8_layers.py",
             "tests/observe/test_fp8_diagnostics.py")  # fmt: skip
BLOCK_TESTS = ("tests/fp8/test_block_formats.py", "tests/fp8/test_block_linear.py", "tests/fp8/test_fp8_layers.py")

GEMM_TESTS = ("tests/gemms/test_gemm_layers.py",)
QUANTIZE_TESTS = ("tests/optim/test_quantize.py",)
STATE_TESTS = ("tests/optim/test_low_bit_state.py",)
SGD_TESTS = ("tests/optim/test_low_bit_sgd.py",)
FUSED_STATE_TESTS = ("tests/optim/test_fused_adam.py",)
CPU_ADAM_TESTS = ("tests/optim/test_cpu_adam.py",)
IN_BACKWARD_TESTS = ("tests/step/test_step_in_backward.py",)
SLICED_TESTS = ("tests/step/test_sliced_gradients.py",)
KEPT_TESTS = ("tests/prepare/test_kept_and_copies.py",)
WHOLE_TESTS = ("tests/prepare/test_whole_swap.py",)
STATE_CHECKPOINT_TESTS = ("tests/step/test_state_precision_checkpoints.py",)
_BEFORE_STEP = """        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:  # with the weight as the forward used it, before its step
            grad_x = (grad2.mm(w.t()) if layer.transposed else grad2.mm(w)).view(x.shape)
        if ctx.needs_input_grad[2]:
            grad_bias = grad2.sum(0)
        layer.backward(grad2, x2)
"""  # a sliced layer's backward: the input's gradient, the bias's, then the weight's slices
KAHAN_TESTS = ("tests/step/test_kahan.py", "tests/optim/test_cpu_lists.py")
STEP_TESTS = ("tests/optim/test_cpu_lists.py",)
BF16_STATE_TESTS = ("tests/optim/test_bf16_state.py",)
PLAN_MEMORY_TESTS = ("tests/observe/test_memory_plan.py",)
MEMORY_BUDGET_TESTS = ("tests/tune/test_memory_budget.py",)

MUTANTS = (
    Mutant("step-scalars-of-another-group", "the group's list steps with the first param group's lr, decay and betas",
           S + "step/stochastic_rounding.py", "cpu_lists.adam_step(rows, adam_scalars(group, step, decoupled)",
           "cpu_lists.adam_step(rows, adam_scalars(self.param_groups[0], step, decoupled)", STEP_TESTS),
    Mutant("step-write-rule-swapped", "bf16-kahan's list writes its weights with bf16-sr's rounding",
           S + "step/kahan.py", "        adam_kahan_update,\n        cpu_lists.KAHAN,",
           "        adam_kahan_update,\n        cpu_lists.STOCHASTIC,",
           STEP_TESTS),
    Mutant("step-moment-skipped", "the list's step leaves the second moment as it was",
           S + "optim/kernels/adam_lists.cpp", "        store_vec(v + k, vk);\n", "", STEP_TESTS),
    Mutant("step-counts-stale", "the host-side step counts ignore a state dict loaded into the running optimizer",
           S + "step/host_counts.py", "last[2] if last is not None and last[0] is t and last[1] == t._version else",
           "last[2] if last is not None else", STEP_TESTS),
    Mutant("host-scalars-root-skipped", "the list's step scalars made on the host leave the second correction unrooted",
           S + "optim/fused_adam.py", "    scalars[5:6].sqrt_()\n", "", STEP_TESTS),
    Mutant("host-scalars-corrections-swapped", "the host-made step scalars give each beta the other's bias correction",
           S + "optim/fused_adam.py", "powf(fp32_nearest(b), count)) for b in (beta1, beta2)]",
           "powf(fp32_nearest(b), count)) for b in (beta2, beta1)]", STEP_TESTS),
    Mutant("moment-seed-shard-unmoved", "the list kernel's bf16 moment seeds ignore where a run of a shard starts",
           S + "optim/kernels/adam_bf16_list.cpp", "    if (r[8] == 1) {", "    if (r[8] == 3) {", STEP_TESTS),
    Mutant("moment-seed-placement-unmixed", "the list kernel mixes another placement's shard seed with the wrong index",
           S + "optim/kernels/adam_bf16_list.cpp", "static_cast<uint64_t>(r[9] + 1));",
           "static_cast<uint64_t>(r[9]));", STEP_TESTS),
    Mutant("moment-keys-swapped", "the bf16 moments' list gives each moment the other's seeds",
           S + "step/low_bit_state.py",
           "keys = (bf16_state.moment_key(moments_base, m), bf16_state.moment_key(moments_base, v))",
           "keys = (bf16_state.moment_key(moments_base, v), bf16_state.moment_key(moments_base, m))", STEP_TESTS),
    Mutant("step-cost-recipes-without-baseline", "bench --recipes (--step-cost, --llama) leaves torch-amp, the "
           "baseline, out", "src/mixprec/cli/bench.py", "return chosen | set(always), None", "return chosen, None",
           ("tests/test_bench.py", "tests/test_llama_bench.py")),
    Mutant("aten-adam-addcmul-unfused", "the ATen Adam(W) kernel's second moment rounds value * g * g before the add "
           "(ATen's is one fused multiply-add): the probe sends every step back to torch's ops",
           S + "optim/kernels/adam_aten_lists.cpp", "at::vec::fmadd(omb2 * gk, gk, VecF::loadu(v + k) * beta2).store",
           "(VecF::loadu(v + k) * beta2 + omb2 * gk * gk).store", ("tests/step/test_own_step.py",)),
    Mutant("aten-adam-tail-divides-first", "the ATen Adam(W) kernel's tail divides the moment before scaling it",
           S + "optim/kernels/adam_aten_lists.cpp", "p[k] = p[k] + s[6] * m[k] / d;",
           "p[k] = p[k] + s[6] * (m[k] / d);", ("tests/step/test_own_step.py",)),
    Mutant("own-step-rest-dropped", "the own-step stage hands torch's step nothing of what it did not take",
           S + "step/own_step.py", "held[:] = [held[i] for i in left]", "held[:] = []",
           ("tests/step/test_own_step.py",)),
    Mutant("own-step-scalars-of-the-first-group", "the own-step stage steps every group with the first's options",
           S + "step/own_step.py", "aten_lists.step_table(table, dtype, group, count, decoupled)",
           "aten_lists.step_table(table, dtype, opt.param_groups[0], count, decoupled)",
           ("tests/step/test_own_step.py",)),
    Mutant("own-step-kept-scalars-of-the-first-group", "a kept table steps its group with the first group's options",
           S + "step/own_step.py", "and self._again(last, group, grads, decoupled):",
           "and self._again(last, opt.param_groups[0], grads, decoupled):", ("tests/step/test_own_step.py",)),
    Mutant("own-step-kept-table-old-gradients", "a kept table steps with the last step's gradients",
           S + "step/own_step.py", "table.set_column(aten_lists.GRADS, [grads[taken[k]].data_ptr() for k in places])",
           "pass", ("tests/step/test_own_step.py",)),
    Mutant("prepared-optimizer-copies", "a prepared optimizer deep-copies and pickles as a plain torch optimizer",
           S + "prepare/levels.py", "    state.handles.append(checks.NoCopy(optimizer))", "    pass",
           ("tests/prepare/test_saving_whole.py",)),
    Mutant("aten-sgd-bf16-tail-as-vector", "the bf16 SGD kernel computes the tails of ATen's shares as its vector "
           "loop (one rounding): the probe sends bf16-pure's SGD step back to torch's ops",
           S + "optim/kernels/sgd_aten_bf16.cpp",
           "return tail ? round_bf16(self + round_bf16(other * alpha)) : round_bf16(self + other * alpha);",
           "return round_bf16(self + other * alpha);",
           ("tests/step/test_own_step.py",)),
    Mutant("aten-sgd-bf16-pair-buffer-unrounded", "the bf16 SGD kernel's vector loop adds the buffer times momentum "
           "unrounded (ATen's mul_ rounds it to bf16)", S + "optim/kernels/sgd_aten_bf16.cpp",
           "            round_pair(m);\n", "", ("tests/step/test_own_step.py",)),
    Mutant("aten-sgd-bf16-shares-unsplit", "the bf16 SGD kernel takes a large tensor as one thread's share",
           S + "optim/kernels/sgd_aten_bf16.cpp",
           "const int64_t shares = (n < GRAIN || threads <= 1) ? 1 : std::min(threads, (n + GRAIN - 1) / GRAIN);",
           "const int64_t shares = 1;", ("tests/step/test_own_step.py",)),
    Mutant("aten-sgd-bf16-foreach-momentum-fp32", "the bf16 SGD kernel multiplies foreach's buffers by an fp32 "
           "momentum", S + "optim/aten_lists.py",
           'applied = _bf16(momentum) if group.get("foreach") and all_started else momentum', "applied = momentum",
           ("tests/step/test_own_step.py",)),
    Mutant("aten-sgd-bf16-foreach-late-buffer", "the bf16 SGD kernel multiplies foreach's buffers by a bf16 momentum "
           "where one was started late", S + "optim/aten_lists.py",
           'applied = _bf16(momentum) if group.get("foreach") and all_started else momentum',
           'applied = _bf16(momentum) if group.get("foreach") else momentum', ("tests/step/test_own_step.py",)),
    Mutant("o2-copies-written-unread", "the fused step writes O2's copies where no eager forward read them (a "
           "compiled model's)", S + "step/own_step.py",
           "return copies is not None and copies.dtype is torch.bfloat16 and copies.read",
           "return copies is not None and copies.dtype is torch.bfloat16", ("tests/step/test_own_step.py",)),
    Mutant("own-step-kept-table-weights-moved", "a kept table is used after a weight was stored anew (.data)",
           S + "step/own_step.py", "return _addresses(lists, self.taken) == self.ptrs and [",
           "return [", ("tests/step/test_own_step.py",)),
    Mutant("fused-lists-tail-grouped-as-rest", "the fused Adam(W) kernel computes its tail's whole groups of 8 as its "
           "single values (torch's compiler vectorized them): the probe sends the fused step back to torch's",
           S + "optim/kernels/adam_fused_lists.cpp",
           "const int64_t grouped = k + (last - k) / TAIL_GROUP * TAIL_GROUP;", "const int64_t grouped = k;",
           ("tests/step/test_own_step.py",)),
    Mutant("fused-lists-bf16-l2-unfused", "the fused Adam(W) kernel adds Adam's L2 decay to bf16 weights' gradients "
           "in two roundings (torch's compiler fused them): the probe sends bf16-pure's fused step back to torch's",
           S + "optim/kernels/adam_fused_lists.cpp", "if (l2) gk[h] = at::vec::fmadd(pk[h], decay, gk[h]);",
           "if (l2) gk[h] = gk[h] + pk[h] * decay;", ("tests/step/test_own_step.py",)),
    Mutant("fused-lists-copies-unwritten", "the fused Adam(W) kernel leaves O2's copies unwritten (told written)",
           S + "optim/kernels/adam_fused_lists.cpp", "        if (copy != nullptr) copy[k] = BF16(pk);\n",
           "", ("tests/step/test_own_step.py",)),
    Mutant("fused-lists-copies-pair-half", "the fused Adam(W) kernel writes half of each pair of vectors' O2 copies",
           S + "optim/kernels/adam_fused_lists.cpp", "            store_pair(copy + k, pair);\n",
           "            store_vec(copy + k, pair[0]);\n", ("tests/step/test_own_step.py",)),
    Mutant("fused-lists-copies-last-vector-unwritten", "the fused Adam(W) kernel leaves the copy of a vector left "
           "after the pairs unwritten", S + "optim/kernels/adam_fused_lists.cpp",
           "        if (copy != nullptr) store_vec(copy + k, pk);\n", "", ("tests/step/test_own_step.py",)),
    Mutant("own-step-versions-still", "the own step writes the weights without moving their versions (a step between a "
           "forward and its backward goes unreported, where torch's for-loop reports it)", S + "step/own_step.py",
           "            versions.move_as_torch(group, stepped)", "            pass",
           ("tests/step/test_own_step.py",)),
    Mutant("own-step-fused-versions-moved", "a one-call step of torch's fused form moves the weights' versions "
           "(torch's fused kernel does not)", S + "step/versions.py", 'if params and not group.get("fused"):',
           "if params:", ("tests/step/test_own_step.py",)),
    Mutant("sr-list-versions-still", "bf16-sr's Adam(W) list writes the bf16 weights without moving their versions",
           S + "step/stochastic_rounding.py",
           "        versions.move_as_torch(group, ours)", "        pass", ("tests/step/test_own_step.py",)),
    Mutant("sr-sgd-list-versions-still", "bf16-sr's SGD list writes the bf16 weights without moving their versions",
           S + "step/stochastic_rounding.py",
           'torch.autograd.graph.increment_version([p for p in group["params"] if id(p) in listed])', "pass",
           ("tests/step/test_own_step.py",)),
    Mutant("state-list-versions-still", "the state precisions' list writes the weights without moving their versions",
           S + "step/low_bit_state.py", "    versions.move_as_torch(group, params)", "    pass",
           ("tests/step/test_own_step.py",)),
    Mutant("o2-copies-written-version-now", "a copy the step wrote is taken as current whatever wrote its master "
           "since", S + "prepare/o2_copies.py", "                    versions[id(p)] = current[id(p)]\n", "",
           ("tests/step/test_own_step.py",)),
    Mutant("o2-copies-current-not-intersected", "a copy written at one step of two before a forward is taken as "
           "current", S + "prepare/o2_copies.py",
           "self.current = written if not self.behind else {k: v for k, v in written.items() if k in current}",
           "self.current = {**current, **written}", ("tests/step/test_own_step.py",)),
    Mutant("own-step-count-stuck", "the own-step stage steps every weight at its first step's count",
           S + "step/own_step.py", "by_kind.setdefault((params[i].dtype, count), [])",
           "by_kind.setdefault((params[i].dtype, 1.0), [])",
           ("tests/step/test_own_step.py",)),
    Mutant("plan-own-step-as-torchs-loop", "the plan counts torch's for-loop temporaries for the fp32 weights one "
           "call steps", S + "observe/param_bytes.py", "if adam and stored == 4 and aten_lists.expected():",
           "if adam and stored == 4 and not aten_lists.expected():", PLAN_MEMORY_TESTS),
    Mutant("plan-own-sgd-as-torchs-loop", "the plan counts torch's for-loop temporaries for SGD's fp32 weights "
           "one call steps", S + "observe/param_bytes.py", "if not adam and stored == 4 and aten_lists.sgd_expected():",
           "if not adam and stored == 4 and not aten_lists.sgd_expected():", PLAN_MEMORY_TESTS),
    Mutant("plan-own-bf16-as-torchs-loop", "the plan counts torch's for-loop temporaries for bf16-pure's weights one "
           "call steps", S + "observe/param_bytes.py",
           "if aten_lists.supports(group, torch.bfloat16, decoupled) and aten_lists.expected(torch.bfloat16):",
           "if not aten_lists.supports(group, torch.bfloat16, decoupled):", PLAN_MEMORY_TESTS),
    Mutant("plan-own-fused-as-torchs", "the plan counts torch's fused step for the fp32 weights one call steps "
           "(no table)", S + "observe/param_bytes.py", "if stored == 4 and fused_lists.expected():",
           "if stored == 4 and not fused_lists.expected():", PLAN_MEMORY_TESTS),
    Mutant("own-step-new-buffers-unsaved", "the own-step stage leaves the momentum buffers it made out of the state",
           S + "step/own_step.py", 'buffer = opt.state[p]["momentum_buffer"] = made',
           "buffer = made", ("tests/step/test_own_step.py",)),
    Mutant("aten-adam-bf16-eps-unrounded", "the ATen Adam(W) kernel adds eps to bf16 values as an fp32 value (add_ "
           "rounds it to bf16): the probe sends bf16-pure's step back to torch's ops", S + "optim/aten_lists.py",
           "        values[5] = _bf16(values[5])", "        pass", ("tests/step/test_own_step.py",)),
    Mutant("aten-adam-bf16-foreach-scalars-unrounded", "the ATen Adam(W) kernel takes foreach's decay and beta2 on "
           "bf16 tensors as fp32 values (_foreach_mul_ rounds them to bf16)", S + "optim/aten_lists.py",
           "            values[0] = _bf16(values[0]) if decoupled else values[0]\n"
           "            values[2] = _bf16(values[2])\n", "            pass\n", ("tests/step/test_own_step.py",)),
    Mutant("aten-probe-seen-by-modes", "the own step's probes run under the dispatch modes around the first step",
           S + "optim/aten_lists.py", "    with _disable_current_modes():", "    with torch.no_grad():",
           ("tests/step/test_own_step.py",)),
    Mutant("llama-fp8-without-its-baseline", "bench --llama --recipes O1+fp8 leaves O1, the fp8 row's baseline, out",
           "src/mixprec/cli/bench.py", '{by_name[n].baseline for n in chosen} | {"torch-amp"}', '{"torch-amp"}',
           ("tests/test_llama_bench.py",)),
    Mutant("llama-recipes-in-table-order", "bench --llama --recipes measures the recipes in the table's order, not "
           "the order asked (a time limit cuts another row)", "src/mixprec/cli/bench.py",
           "recipes = tuple(by_name[n] for n in dict.fromkeys([*baselines, *asked]))",
           "recipes = tuple(r for r in llama.RECIPES if r.name in {*baselines, *asked})",
           ("tests/test_llama_bench.py",)),
    Mutant("llama-recipe-unprepared", "bench --llama trains every recipe as torch.amp's fp32 model",
           "src/mixprec/bench/llama.py", "return mixprec.prepare(model, optimizer, level=self.level, **options)",
           "return model, optimizer", ("tests/test_llama_bench.py",)),
    Mutant("llama-ratio-inverted", "bench --llama's ratio is the recipe's time over its baseline's",
           "src/mixprec/bench/llama.py", "row.vs_baseline = against.step_ms / row.step_ms",
           "row.vs_baseline = row.step_ms / against.step_ms", ("tests/test_llama_bench.py",)),
    Mutant("counts-last-unwritten", "the step counts' C++ write leaves the last step tensor as it was",
           S + "optim/kernels/step_counts.cpp", "for (int64_t i = 0; i < n; ++i)",
           "for (int64_t i = 0; i + 1 < n; ++i)", STEP_TESTS),
    Mutant("counts-written-unreported", "the step counts are written without moving the tensors' version counters",
           S + "optim/cpu_lists.py", "    torch.autograd.graph.increment_version(steps)\n", "", STEP_TESTS),
    Mutant("counts-written-under-a-mode", "under a dispatch mode the step counts are written where the mode cannot see",
           S + "step/host_counts.py", "    if not dispatch_modes.active() and cpu_lists.counts_build():",
           "    if cpu_lists.counts_build():", STEP_TESTS),
    Mutant("step-compiled-under-dispatch-mode", "a step under FlopCounterMode calls the compiled kernel (it raises)",
           S + "step/stochastic_rounding.py", "run = eager if mode else kernel", "run = kernel", STEP_TESTS),
    Mutant("state-list-block-skipped", "the quantized list steps every block of a chunk of its work but the last",
           S + "optim/kernels/adam_quantized_list.cpp", "for (int64_t b = first; b < last; ++b) {",
           "for (int64_t b = first; b + 1 < last; ++b) {", STEP_TESTS),
    Mutant("lists-chunk-short", "the list kernels' chunks of work end a value (a block) short",
           S + "optim/kernels/vector_helpers.h", "body(row, first, std::min(first + chunk, row[size_at]));",
           "body(row, first, std::min(first + chunk - 1, row[size_at]));", STEP_TESTS),
    Mutant("state-list-moment-seeds-swapped", "the bf16 moments' list rounds each moment with the other's noise",
           S + "optim/kernels/adam_bf16_list.cpp", "moment_seed(m_key, count, r), moment_seed(v_key, count, r));",
           "moment_seed(v_key, count, r), moment_seed(m_key, count, r));", STEP_TESTS),
    Mutant("state-list-step-count-stale", "the state precisions' list steps with the count before this step",
           S + "step/low_bit_state.py", "        scalars = _scalars(group, count, decoupled)",
           "        scalars = _scalars(group, count - 1, decoupled)", STEP_TESTS),
    Mutant("o2-refresh-at-every-step", "O2's copies refreshed at each step, though a compiled forward never reads them",
           S + "prepare/levels.py", "register_step_post_hook(lambda *_: copies.stale())",
           "register_step_post_hook(lambda *_: copies.refresh())", ("tests/prepare/test_master_weights.py",)),
    Mutant("o2-stale-copies-read", "O2's forward after a step reads the copies the step left behind",
           S + "prepare/o2_copies.py",
           "        self.read = True\n        if self.behind:\n            self.refresh()\n",
           "        self.read = True\n", ("tests/prepare/test_master_weights.py", *WHOLE_TESTS)),
    Mutant("sgd-list-nesterov-ignored", "the SGD list steps a Nesterov group with the plain momentum",
           S + "optim/kernels/sgd_lists.cpp", "gk[h] = nesterov ? at::vec::fmadd(b[h], m, gk[h]) : b[h];",
           "gk[h] = b[h];", STEP_TESTS),
    Mutant("sgd-list-buffer-restarted", "the SGD list starts every momentum buffer again from the gradient",
           S + "step/stochastic_rounding.py", "rows.append((local_p, local_g, None if buffer is None else "
           "sharding.local(buffer), comp, seed, started))", "rows.append((local_p, local_g, None if buffer is None "
           "else sharding.local(buffer), comp, seed, False))", STEP_TESTS),
    Mutant("sgd-list-damping-ignored", "the SGD list adds the whole gradient to the momentum, dampening aside",
           S + "optim/cpu_lists.py", '1.0 - float(group["dampening"])', "1.0", STEP_TESTS),
    Mutant("sgd-bf16-buffer-weights-noise", "the bf16 momentum list rounds each buffer with its weight's noise",
           S + "optim/kernels/sgd_bf16_state.cpp", "        pair_sr(b, k, buf_seed);\n",
           "        pair_sr(b, k, seed);\n", STEP_TESTS),
    Mutant("sgd-quantized-list-unsigned", "the quantized momentum list codes the buffer with the unsigned codebook",
           S + "optim/cpu_lists.py", "signed_table, signed_lookup, _, _ = cpu_adam._tables(fmt)",
           "_, _, signed_table, signed_lookup = cpu_adam._tables(fmt)", STEP_TESTS),
    Mutant("sgd-quantized-list-never-started", "the quantized momentum list starts every buffer from the gradient",
           S + "step/low_bit_state.py", "state, comp, 0 if seed is None else seed, started[i])",
           "state, comp, 0 if seed is None else seed, False)", STEP_TESTS),
    Mutant("o2-copies-per-parameter", "O2's copies refreshed one parameter at a time after a step",
           S + "prepare/o2_copies.py", "torch._foreach_copy_([self.copies[id(p)] for p in behind], list[torch.Te",
           "[self.copies[id(p)].copy_(p) for p in behind] or ([], list[torch.Te", PREPARE_TESTS),
    Mutant("bf16-state-rounds-nearest", "bf16 moments are stored rounded to nearest, not stochastically",
           S + "step/bf16_state.py", "    bits = sr_bits(value.contiguous(), seed_tensor(seed, value.device))\n"
           "    target.copy_(bits.view(torch.float32).view(target.shape))",
           "    target.copy_(value.view(target.shape))", BF16_STATE_TESTS),
    Mutant("bf16-state-kernel-rounds-nearest", "cpu_adam's bf16-state kernel stores the first moment to nearest",
           S + "optim/kernels/adam_bf16.cpp", "store_vec(m + k, vec_sr(mk, k, m_seed));", "store_vec(m + k, mk);",
           BF16_STATE_TESTS),
    Mutant("bf16-state-kernel-one-noise", "the bf16-state kernel rounds the second moment with the first's noise",
           S + "optim/kernels/adam_bf16.cpp", "store_vec(v + k, vec_sr(vk, k, v_seed));",
           "store_vec(v + k, vec_sr(vk, k, m_seed));", BF16_STATE_TESTS),
    Mutant("bf16-state-pairs-round-nearest", "the bf16-state kernel's two-vector loop stores the first moment to "
           "nearest", S + "optim/kernels/adam_bf16.cpp", "        pair_sr(mk, k, m_seed);\n", "", BF16_STATE_TESTS),
    Mutant("bf16-state-pairs-one-noise", "the bf16-state kernel's two-vector loop rounds the second moment with the "
           "first's noise", S + "optim/kernels/adam_bf16.cpp", "pair_sr(vk, k, v_seed);", "pair_sr(vk, k, m_seed);",
           BF16_STATE_TESTS),
    Mutant("taken-before-state-unchecked", "a list takes a weight it took before whatever its state tensors are now",
           S + "step/taken_before.py", "            if t is None or ref() is not t:", "            if t is None:",
           STEP_TESTS),
    Mutant("taken-before-gone-matches", "a state tensor gone since a list took it matches a missing one",
           S + "step/taken_before.py", "            if t is None or ref() is not t:",
           "            if ref() is not t:", STEP_TESTS),
    Mutant("in-backward-small-norms-dropped", "not clipping, the step in backward leaves the small parameters out "
           "of the norm", S + "step/step_in_backward.py",
           "            if self.max_norm is None:\n                self.add_norm([p.grad for p in waiting])",
           "            if False:\n                self.add_norm([p.grad for p in waiting])", IN_BACKWARD_TESTS),
    Mutant("sr-scalars-cache-stale", "bf16-sr's list reuses the last scalars whatever the step count and lr",
           S + "step/sr_kernel.py", "    if _last[0] == key:", "    if _last[0] is not None:",
           ("tests/step/test_stochastic_rounding.py",)),
    Mutant("in-backward-held-squares-dropped", "not clipping, the step in backward never sums the squares it held",
           S + "step/step_in_backward.py", "        if self.squares:  #", "        if False:  #", IN_BACKWARD_TESTS),
    Mutant("square-norms-misplaced", "the held gradients' norms of one dtype are put back in reverse order",
           S + "step/grad_norms.py", "        order += places\n", "        order += places[::-1]\n", IN_BACKWARD_TESTS),
    Mutant("square-norms-last-row-skipped", "the held gradients' norms made in one call leave the last one unwritten",
           S + "optim/kernels/square_norm.cpp", "    for (int64_t i = 0; i < n; ++i) {\n        float total",
           "    for (int64_t i = 0; i + 1 < n; ++i) {\n        float total", IN_BACKWARD_TESTS),
    Mutant("pairs-kahan-dropped", "a pair's Kahan write forgets the compensation",
           S + "optim/kernels/vector_helpers.h", "        store_pair(comp + k, sum);\n", "", BF16_STATE_TESTS),
    Mutant("pairs-second-half-noise", "a pair's second vector rounds with the first's noise positions",
           S + "optim/kernels/vector_helpers.h", "x[1] = vec_sr(x[1], pos + VecF::size(), seed);",
           "x[1] = vec_sr(x[1], pos, seed);", BF16_STATE_TESTS),
    Mutant("budget-skips-bf16-state", "a memory budget never tries bf16 moments (O2 goes to fp8 state instead)",
           S + "tune/memory_fit.py", '    {"optimizer_state": "bf16"},\n', "", MEMORY_BUDGET_TESTS),
    Mutant("bf16-state-chunk-noise-from-zero", "each chunk of a moment takes the noise of the tensor's first values",
           S + "step/bf16_state.py", "_round_into(m_old, m, moved(seeds[0], first))",
           "_round_into(m_old, m, seeds[0])", BF16_STATE_TESTS),
    Mutant("bf16-state-left-fp32-on-load", "a loaded checkpoint's moments stay as load_state_dict cast them (fp32)",
           S + "step/bf16_state.py", "                    state[name] = value.to(torch.bfloat16)",
           "                    state[name] = value", BF16_STATE_TESTS),
    Mutant("bf16-state-sgd-first-buffer-zero", "SGD's first step with bf16 momentum starts from a zero buffer",
           S + "step/bf16_state.py", "buf_old.float() if started else None", "buf_old.float()",
           BF16_STATE_TESTS),
    Mutant("bf16-state-chunks-overlap", "a chunk's temporaries live on while the next chunk's are made",
           S + "step/bf16_state.py", "        del copies, m, v, new\n", "", PLAN_MEMORY_TESTS),
    Mutant("plan-bf16-state-kernel-scalars-left-out", "the plan leaves out the scalars of the CPU list kernels",
           S + "observe/memory_plan.py", "temporary = LIST_SCALARS[form] + cpu_rows[table]",
           "temporary = cpu_rows[table]", PLAN_MEMORY_TESTS),
    Mutant("plan-bf16-state-four-bytes", "the plan counts bf16 moments at fp32's four bytes",
           S + "observe/param_bytes.py", "            return count * numel * 2 + step + comp",
           "            return count * numel * 4 + step + comp", BF16_STATE_TESTS + PLAN_MEMORY_TESTS),
    Mutant("plan-bf16-state-no-temporaries", "the plan leaves the bf16 step's chunk copies out",
           S + "observe/param_bytes.py", "return arrays * 4 * min(numel, bf16_state.CHUNK) + 4, 0, \"\"",
           "return 0, 0, \"\"", PLAN_MEMORY_TESTS),
    Mutant("state-codes-cast-on-load", "a loaded checkpoint's codes and scales are left as load_state_dict cast them",
           S + "step/state_dicts.py", "{k: sharding.local(v).to(param.device) for k, v in tensors.items()}",
           "{k: sharding.local(v).to(param.device, param.dtype) for k, v in tensors.items()}", STATE_TESTS),
    Mutant("state-fp8-unscaled", "fp8 moments are cast without their block's scale (small values flush)",
           S + "optim/quantize.py", "    scaled = blocks / scale[:, None]\n    codes = scaled.to(FP8)",
           "    scaled = blocks\n    codes = scaled.to(FP8)", STATE_TESTS),
    Mutant("state-second-moment-flushes", "a positive 8-bit second moment below the smallest step is stored as zero",
           S + "optim/quantize.py", "        codes = torch.where((scaled > 0) & (codes == 0), 1, codes)\n", "",
           QUANTIZE_TESTS + STATE_TESTS),
    Mutant("state-fp8-second-moment-flushes", "a positive fp8 second moment below e4m3's smallest is stored as zero",
           S + "optim/quantize.py", "    if not signed:\n        smallest", "    if False:\n        smallest",
           STATE_TESTS),
    Mutant("state-sr-seed-of-this-count", "at bf16-sr, quantized-state weights round with the last count's noise",
           S + "step/low_bit_state.py", "    return int(group[SEED_KEY]), int(group[STEP_KEY]) + 1",
           "    return int(group[SEED_KEY]), int(group[STEP_KEY])", (*STATE_TESTS, *STEP_TESTS)),
    Mutant("state-sr-rounds-nearest", "at bf16-sr, quantized-state weights are written rounded to nearest",
           S + "step/low_bit_state.py",
           "seed = _weight_seed(base, next_count, where[id(p)], p) if low and stochastic else None",
           "seed = None",
           (*STATE_TESTS, *STEP_TESTS)),
    Mutant("state-sgd-nesterov-ignored", "quantized-momentum SGD ignores nesterov",
           S + "optim/sgd.py", 'd = g32.add(buf, alpha=momentum) if group["nesterov"] else buf', "d = buf", SGD_TESTS),
    Mutant("state-small-quantized", "biases and other small parameters get quantized moments too",
           S + "step/low_bit_state.py", "if p.grad is None or p.numel() < moments.MIN_NUMEL:",
           "if p.grad is None:", STATE_TESTS),
    Mutant("state-step-uses-stored-moments", "the update uses the moments as stored (quantized), not this step's",
           S + "optim/adam.py", "    denom = (v.sqrt() / bias_correction2.sqrt()) + eps\n",
           "    m = moments.load(state, 'exp_avg', p.shape)\n"
           "    denom = (v.sqrt() / bias_correction2.sqrt()) + eps\n", STATE_TESTS),
    Mutant("state-one-scale", "a state tensor's blocks share one scale (the whole tensor's maximum)",
           S + "optim/quantize.py", "scale = blocks.abs().amax(dim=1).clamp(min=_EPS)\n",
           "scale = blocks.abs().amax().clamp(min=_EPS).expand(blocks.shape[0])\n", QUANTIZE_TESTS),
    Mutant("state-4bit-zero", "the 4-bit second moment's codebook has a zero entry",
           S + "optim/quantize.py", "torch.linspace(0, 1, 17)[1:]", "torch.linspace(0, 1, 16)", QUANTIZE_TESTS),
    Mutant("state-rounds-down", "a value takes the codebook entry below it, not the nearest",
           S + "optim/quantize.py", "x - low >= (high - low) * 0.5", "x - low >= (high - low)", QUANTIZE_TESTS),
    Mutant("state-4bit-packed-swapped", "4-bit codes packed second value first",
           S + "optim/quantize.py", "codes = (codes[::2] << 4) | codes[1::2]",
           "codes = (codes[1::2] << 4) | codes[::2]", QUANTIZE_TESTS),
    Mutant("gemm-conv1d-not-transposed", "a Conv1D's (in, out) weight is read as (out, in) without a transpose",
           S + "gemms/kinds.py", "    if kind is CONV1D:\n        return w.t()",
           "    if kind is CONV1D:\n        return w.reshape(w.shape[1], w.shape[0])", GEMM_TESTS),
    Mutant("gemm-mha-qkv-misordered", "the routed attention splits its packed projection k, q, v",
           S + "gemms/attention.py", "q, k, v = proj[0], proj[1], proj[2]", "q, k, v = proj[1], proj[0], proj[2]",
           GEMM_TESTS),
    Mutant("gemm-out-proj-not-called", "the routed attention computes its out-projection from the weights",
           S + "gemms/attention.py", "    out = self.out_proj(out)  # the out-projection, as a layer",
           "    out = F.linear(out, self.out_proj.weight, self.out_proj.bias)", GEMM_TESTS),
    Mutant("gemm-kind-not-reported", "a module holding a GEMM's weight but no layer is not reported",
           S + "gemms/sites.py", "        if reason is not None:\n            out.append((name, reason))\n", "",
           GEMM_TESTS),
    Mutant("gemm-fused-path-kept", "an encoder layer with layers of their own precision keeps torch's fused path",
           S + "gemms/fused_paths.py", "            _uncalled(layer).register_forward_pre_hook(_no_fused_path)\n", "",
           GEMM_TESTS),
    Mutant("gemm-fused-path-hook-on-the-layer", "the hook turning the fused encoder path off sits on the layer (every "
           "training call takes _call_impl's slow path)", S + "gemms/fused_paths.py",
           "        return attention.out_proj\n", "        return layer\n", KEPT_TESTS),
    Mutant("gemm-patch-order", "a patch convolution lays out its patches kernel before channels",
           S + "gemms/kinds.py", "order = [0, *(2 + 2 * i for i in range(n)), 1, *(3 + 2 * i for i in range(n))]",
           "order = [0, *(2 + 2 * i for i in range(n)), *(3 + 2 * i for i in range(n)), 1]", GEMM_TESTS),
    Mutant("gemm-head-is-a-projection", "an attention's out_proj can be taken for the output head",
           S + "fp8/conversion.py", " and sites.attention_of(model, n) is None]", "]", GEMM_TESTS),
    # --- the six the suite was first checked against -------------------------------------------------
    Mutant("scaler-never-skips", "GradScaler steps even when the gradients hold inf/NaN",
           S + "scaling/torch_members.py", "        if skipped:\n            self._events.skipped(",
           "        if False:\n            self._events.skipped(",
           SCALER_TESTS),
    Mutant("prepare-drops-norm-rule", "prepare keeps no module in fp32",
           S + "prepare/levels.py", "    kept.keep_in_fp32(kept_modules, device_type, state.handles, policy)\n", "",
           PREPARE_TESTS),
    Mutant("edits-are-no-ops", "a policy's edits register no kernels",
           S + "amp/dispatch.py", "    if device_type not in AUTOCAST_KEYS:\n        return ()",
           "    if True:\n        return ()", ("tests/amp/test_autocast_ops.py", "tests/amp/test_drop_in.py")),
    Mutant("weight-cast-cache-off", "edited-op kernels cast a weight again at every use (two casts, two gradients)",
           S + "amp/dispatch.py", "        and torch.is_autocast_cache_enabled()\n",
           "        and torch.is_autocast_cache_enabled() and False\n", AUTOCAST_TESTS),
    Mutant("promote-no-op", "the promote category casts nothing",
           S + "amp/dispatch.py",
           "        args, kwargs = cast_all(args, kwargs, _promote_dtype(tensors, device_type), device_type)\n", "",
           ("tests/amp/test_autocast_ops.py",)),
    Mutant("fused-step-syncs", "the fused-optimizer scaler step reads found_inf on the host every iteration",
           S + "scaling/scaler.py", "        optimizer.found_inf = found_tensor  # type: ignore[attr-defined]\n",
           "        optimizer.found_inf = found_tensor  # type: ignore[attr-defined]\n        found_tensor.tolist()\n",
           SCALER_TESTS),
    # --- kernels and casting ------------------------------------------------------------------------
    Mutant("fp32-set-dtype-no-op", "ops in fp32_set_dtype run without dtype=fp32",
           S + "amp/dispatch.py", '                kwargs = {**kwargs, "dtype": _float32}',
           "                pass", ("tests/amp/test_autocast_ops.py",)),
    Mutant("replay-skips-policy", "checkpoint_context's recompute runs without the policy",
           S + "amp/checkpoint_replay.py", "            region.push(device_type, policy, None)\n",
           "            pass\n",
           ("tests/amp/test_drop_in.py",)),
    # --- module rules and prepare levels ------------------------------------------------------------
    Mutant("kept-inputs-not-fp32", "a module kept in fp32 gets its low-precision inputs as they are",
           S + "prepare/kept.py",
           "    return casting.cast_floating((args, kwargs), torch.float32, device_type)",
           "    return args, kwargs", PREPARE_TESTS),
    Mutant("o2-grad-lost", "O2's low-precision copy (two views) passes no gradient to the fp32 parameter",
           S + "prepare/o2_copies.py", "    return widen[...]  # recorded", "    return held  # recorded",
           KEPT_TESTS),
    Mutant("o2-sparse-grad-lost", "O2's copy of a sparse embedding passes no gradient to the fp32 parameter",
           S + "prepare/o2_copies.py", "        return grad.to(ctx.master_dtype), None",
           "        return None, None", KEPT_TESTS),
    Mutant("o2-uses-summed-wide", "O2 sums a weight's uses' gradients in fp32, where the copy's dtype did before",
           S + "prepare/o2_copies.py", "    return widen[...]  # recorded", "    return widen  # recorded",
           KEPT_TESTS),
    Mutant("o2-one-view-grad-lost", "a torch layer's O2 copy (one view) passes no gradient to the fp32 parameter",
           S + "prepare/o2_copies.py", "                        held = widen if once else widen[...]",
           "                        held = held if once else widen[...]", PREPARE_TESTS),
    Mutant("o2-one-view-everywhere", "every module's O2 copy is one view: a weight used twice is summed in fp32",
           S + "prepare/o2_copies.py", "once = self.torch_layer and ", "once = True or ", KEPT_TESTS),
    Mutant("o2-one-view-nowhere", "a torch layer's O2 copy takes the two views (a backward node more a weight)",
           S + "prepare/o2_copies.py", "once = self.torch_layer and ", "once = False and ", KEPT_TESTS),
    Mutant("o2-view-kept-past-a-write", "O2's kept view of a master is used after the master was written in place "
           "(autograd remakes its node as a strided copy)", S + "prepare/o2_copies.py",
           "kept[1] is held and kept[2] == version else", "kept[1] is held else", KEPT_TESTS),
    Mutant("o2-view-kept-for-an-old-copy", "O2's kept view holds the copy of a master since stored anew",
           S + "prepare/o2_copies.py", "kept[1] is held and kept[2] == version else", "kept[2] == version else",
           KEPT_TESTS),
    Mutant("o2-view-kept-with-a-users-hook", "O2's kept view is used again after a hook was put on it (the hook "
           "runs once more each forward)", S + "prepare/o2_copies.py",
           "if widen is None or widen._backward_hooks is not None:", "if widen is None:", KEPT_TESTS),
    Mutant("o2-swap-after-hooks-only", "O2's copies go in place inside the module's hooks, not around them",
           S + "prepare/o2_copies.py", "            module._call_impl = call  # type: ignore[method-assign]\n",
           "            module._call_impl = call  # type: ignore[method-assign]\n"
           "            module.__dict__.pop('_call_impl')\n"
           "            module.register_forward_pre_hook(call.swap.enter, prepend=True)\n"
           "            module.register_forward_hook(call.swap.leave, always_call=True)\n", KEPT_TESTS),
    Mutant("o2-kept-swap-past-a-replacement", "a layer's kept swap is put over a parameter replaced since (the "
           "optimizer no longer steps it, silently)", S + "prepare/o2_copies.py",
           "                params[name] is not master\n                or master._version",
           "                False\n                or master._version", KEPT_TESTS + WHOLE_TESTS),
    Mutant("o2-kept-swap-past-a-write", "a layer's kept swap is put after its master was written (a stale copy)",
           S + "prepare/o2_copies.py", "                or master._version != version\n", "", KEPT_TESTS),
    Mutant("o2-kept-swap-past-new-data", "a layer's kept swap is put after its master's data was stored anew",
           S + "prepare/o2_copies.py", "                or master.data_ptr() != at\n", "", KEPT_TESTS),
    Mutant("o2-kept-swap-past-a-thaw", "a layer's kept swap (a copy without history) is put after its master was "
           "thawed: no gradient", S + "prepare/o2_copies.py", "                or master.requires_grad is not wants\n",
           "", WHOLE_TESTS),
    Mutant("o2-kept-swap-past-a-hook", "a layer's kept swap is put again after a user's hook went on it",
           S + "prepare/o2_copies.py", "                or put._backward_hooks is not None\n", "", KEPT_TESTS),
    Mutant("o2-data-stored-anew-unseen", "O2's copy stays the old one after a master's data was stored anew "
           "(p.data = t: the version does not move)", S + "prepare/o2_copies.py",
           "                    or address(master) != addresses.get(key)  # type: ignore[arg-type]\n", "",
           WHOLE_TESTS),
    Mutant("o2-attention-out-proj-cast", "an attention's out_proj's weight is cast at each use (not swapped with it)",
           S + "prepare/o2_copies.py", "                attention.swap.inner = (out.module, out.swap)",
           "                pass", WHOLE_TESTS),
    Mutant("o2-whole-swap-off", "O2's copies go in place one layer call at a time: a parent reads the master",
           S + "prepare/levels.py", "        and o2_copies.enter_whole(copies, torch.compiler.is_compiling())\n",
           "        and False\n", WHOLE_TESTS),
    Mutant("o2-whole-swap-calls-kept-lifted", "after the model's call the layers keep no call of their own",
           S + "prepare/o2_copies.py", '            found["_call_impl"] = call  # not through',
           "            (call  # not", WHOLE_TESTS),
    Mutant("o2-whole-swap-eager-only", "a compiled O2 forward swaps one layer call at a time: a parent reads the "
           "master where the eager forward reads the copy", S + "prepare/levels.py",
           "        and o2_copies.enter_whole(copies, torch.compiler.is_compiling())\n",
           "        and not torch.compiler.is_compiling()\n        and o2_copies.enter_whole(copies)\n", WHOLE_TESTS),
    Mutant("o2-whole-swap-unwound-early", "a layer failing to swap leaves those lifted before it without calls",
           S + "prepare/o2_copies.py", "    except BaseException:\n        leave_whole(copies)\n        raise\n",
           "    except BaseException:\n        copies.lifted = None\n        raise\n", WHOLE_TESTS),
    Mutant("o2-refresh-some-written-as-all", "O2's refresh skips every copy where the step wrote some of them",
           S + "prepare/o2_copies.py", "        if current and current.keys() == self.versions.keys():",
           "        if current:", PREPARE_TESTS + KEPT_TESTS + WHOLE_TESTS + ("tests/step/test_own_step.py",)),
    Mutant("plan-o2-swap-per-call", "the memory plan swaps O2's copies around each layer's call (counts the casts "
           "of weights read outside it, which the whole-model swap does not make)",
           S + "observe/activation_trace.py", "whole = config.fp8 is None and o2_copies.swapped_whole(module)",
           "whole = False", ("tests/observe/test_memory_plan.py",)),
    Mutant("fused-path-ignores-o2-calls", "eval's fused encoder kernel skips O2's layers (it reads the fp32 masters)",
           S + "gemms/fused_paths.py", ' or "_call_impl" in m.__dict__ for m', " for m", KEPT_TESTS),
    Mutant("step-cost-compiled-at-default-limit", "the compiled step-cost table leaves dynamo's recompile limit at 8",
           "src/mixprec/bench/step_cost.py",
           "    limit = torch._dynamo.config.recompile_limit + 2 * len(recipes)",
           "    limit = torch._dynamo.config.recompile_limit", ("tests/test_bench.py",)),
    Mutant("kept-own-forward-not-fp32", "a torch norm kept by its own forward computes on its bf16 input",
           S + "prepare/kept.py", "        return input.float()", "        return input", KEPT_TESTS),
    Mutant("kept-own-forward-ignores-policy", "a norm whose op the policy lowers is kept without the hooks",
           S + "prepare/kept.py", "(None, OpCategory.FP32) else None", "(None, OpCategory.FP32) else forward",
           KEPT_TESTS),
    Mutant("norm-names-ignored", "a norm of another library (LlamaRMSNorm, T5LayerNorm) is not kept in fp32",
           S + "policy/keep.py", "if isinstance(module, self.types) or (self._norms and named_like_a_norm(module)):",
           "if isinstance(module, self.types):", KEPT_TESTS),
    Mutant("norm-named-block-kept", "a block named like a norm, with a projection inside, is kept as a norm",
           S + "policy/keep.py", "return not any(True for child in module.children() for _ in child.parameters())",
           "return True", KEPT_TESTS),
    Mutant("kept-fused-path-on", "in evaluation torch's fused encoder path skips a kept norm's own forward",
           S + "prepare/levels.py", "    fused_paths.keep_layers_called(model)  # a kept norm",
           "    pass  # a kept norm", KEPT_TESTS),
    Mutant("o2-copies-stale", "O2's copies are not refreshed after optimizer.step()",
           S + "prepare/levels.py",
           "            state.handles.append(optimizer.register_step_post_hook(lambda *_: copies.stale()))",
           "            pass", PREPARE_TESTS),
    Mutant("o2-writes-ignored", "O2's copies do not follow writes into the weights (version counters ignored)",
           S + "prepare/o2_copies.py", "            param._version != self.versions[key]\n",
           "            False\n", PREPARE_TESTS),
    Mutant("outputs-not-cast", "a prepared model's floating outputs come back in low precision",
           S + "prepare/levels.py",
           "    return out if state.output_dtype is None else casting.cast_floating(out, state.output_dtype)",
           "    return out", PREPARE_TESTS),
    Mutant("sr-rounds-to-nearest", "bf16-sr writes the weights back rounded to nearest",
           S + "step/sr_noise.py", "    noise = ((weyl + seed) >> 16) & 0xFFFF",
           "    noise = 0x8000 + 0 * weyl", PREPARE_TESTS),
    Mutant("sr-seed-not-saved", "the rounding counters are not restored from a state dict",
           S + "step/stochastic_rounding.py", "                group.setdefault(key, value)",
           "                group[key] = value",
           PREPARE_TESTS),
    # --- FSDP2 ------------------------------------------------------------------------------------------
    Mutant("fsdp-unit-precision-unset", "FSDP2 units keep gathering fp32 at O2",
           S + "sharding.py",
           "    unit.mp_policy = dataclasses.replace(current, param_dtype=param_dtype, reduce_dtype=reduce_dtype)",
           "    pass", ("tests/prepare/test_sharding.py",)),
    Mutant("fsdp-kept-gathered-low", "O2 under FSDP2 gathers the kept norms in low precision",
           S + "sharding.py", "    fsdp_param.param_dtype = None", "    pass",
           ("tests/prepare/test_sharding.py",)),
    Mutant("sr-shard-offset-ignored", "a shard rounds as if it were the start of the tensor",
           S + "step/sr_noise.py", "    return _int32(seed + offset * _WEYL)", "    return seed",
           ("tests/prepare/test_sharding.py",)),
    Mutant("sharded-after-prepare-unseen", "prepare then fully_shard trains without a word",
           S + "prepare/checks.py", "    if not state.sharded and sharding.fsdp_modules(model):",
           "    if False:", ("tests/prepare/test_sharding.py",)),
    # --- scaler and tune ----------------------------------------------------------------------------------
    Mutant("scaler-ranks-disagree", "with process_group, each rank still skips on its own flags only",
           S + "scaling/unscaling.py", "dist.all_reduce(found, op=dist.ReduceOp.SUM, group=process_group)",
           "pass", ("tests/test_distributed.py",)),
    Mutant("scaler-no-backoff", "an overflowing iteration does not shrink the loss scale",
           S + "scaling/loss_scale.py", "scale, good, found, self.growth_factor, self.backoff_factor,",
           "scale, good, found, self.growth_factor, 1.0,", SCALER_TESTS),
    Mutant("hysteresis-ignored", "every overflow backs the scale off, however many the hysteresis tolerates",
           S + "scaling/loss_scale.py", "        back_off = overflow & (tolerated <= 0)",
           "        back_off = overflow", SCALER_TESTS),
    Mutant("tune-no-head-to-head", "tune chooses from figures measured in rounds apart, without a final race",
           S + "tune/search.py", "    finalists = search.final_round(torch_default, dtypes, min_speedup, notes)",
           "    finalists = None", ("tests/tune/test_tune.py",)),
    Mutant("tune-ignores-loss", "tune's guard accepts any loss",
           S + "tune/trial.py", "    if err > tol.loss_rtol:", "    if False:", ("tests/tune/test_tune.py",)),
    Mutant("memory-masters-as-parameters", "memory_report counts O2's fp32 masters as parameters",
           S + "observe/memory_report.py", "            if id(p) in lowp:", "            if False:",
           (S + "observe/memory_report.py", "docs/distributed.md")),
    Mutant("policy-string-drops-hints", "a banned op's hint is left out of the policy's string form",
           S + "policy/rules.py",
           '''            items = [n if policy.banned[n] == BANNED_HINT else f"{n}:{policy.banned[n]!r}"'''
           ''' for n in moved]''',
           "            items = moved", POLICY_TESTS),
    Mutant("edited-name-unmarked", "an edited policy keeps the built-in's name",
           S + "policy/rules.py",
           "        name = self.name if self.name.endswith(EDITED) else self.name + EDITED",
           "        name = self.name", POLICY_TESTS),
    Mutant("listener-not-removed", "remove_listener leaves the callback listening",
           S + "scaling/scaler.py", "            self._events.listeners.remove(callback)", "            pass",
           SCALER_TESTS),
    Mutant("keep-filter-ignored", "prepare keeps no module that PrepareConfig.keep_filter accepts",
           S + "prepare/config.py",
           "        return self.keep_filter is not None and bool(self.keep_filter(module, name))",
           "        return False", PREPARE_TESTS),
    Mutant("config-policy-ignored", "the prepared forward runs the built-in lists whatever the config's policy",
           S + "prepare/levels.py",
           "    policy = state.config.policy if state.config.policy is not None else default_policy(state.device_type)",
           "    policy = default_policy(state.device_type)", PREPARE_TESTS),
    Mutant("pickle-mid-iteration", "a GradScaler pickles between scale() and update(), losing the iteration",
           S + "scaling/scaler.py",
           "        if self._enabled and self._iteration.in_progress() and not self._iteration.failed:",
           "        if False:", SCALER_TESTS),
    Mutant("no-grad-refused", "an edited policy under no_grad is taken for a reentrant checkpoint and refused",
           S + "amp/dispatch.py", "            if frame.f_code is _CHECKPOINT_FORWARD:",
           "            if frame.f_code is not _CHECKPOINT_FORWARD:", AUTOCAST_TESTS),
    Mutant("fp32-kernel-drops-kwargs", "an op moved to fp32 loses its keyword arguments (scale=, dtype=)",
           S + "amp/dispatch.py",
           "        args, kwargs = cast_all(args, kwargs, _float32, device_type)\n        return func(*args, **kwargs)",
           "        args, kwargs = cast_all(args, kwargs, _float32, device_type)\n        return func(*args)",
           ("tests/amp/test_autocast_ops.py",)),
    Mutant("output-tuple-not-cast", "output_dtype casts single outputs only, not a tuple's",
           S + "amp/dispatch.py", "        return tuple(_cast_output(o, dtype) for o in out)",
           "        return out", ("tests/amp/test_autocast_ops.py",)),
    # --- per-layer precision: the plan and the guard ---------------------------------------------------
    Mutant("layer-dtype-ignored", "a layer given a dtype computes in the region's",
           S + "layers/precision.py", "x, w = input.to(dtype), weight.to(dtype)", "x, w = input, weight",
           LAYER_TESTS),
    Mutant("recipe-ignores-layers", "Recipe.apply leaves the per-layer plan out",
           S + "tune/recipe.py", "        layer_choice.apply(model, self.layers)\n", "",
           LAYER_TESTS),
    Mutant("plan-ignores-floor", "a layer's precision below its SQNR floor can be chosen",
           S + "layers/choice.py", "            if quality < floor_db:", "            if False:",
           LAYER_TESTS),
    Mutant("plan-fp8-slower-than-bf16", "fp8 is chosen where it measured slower than bf16",
           S + "layers/choice.py", "if not fp8_allowed or (high is not None and ms >= high):",
           "if not fp8_allowed:", LAYER_TESTS),
    Mutant("guard-no-patience", "the guard moves a layer at its first bad step",
           S + "layers/guard.py", "if self.strikes[name] >= self.thresholds.patience:", "if True:",
           LAYER_TESTS),
    Mutant("guard-strikes-not-in-a-row", "a step without a signal does not reset the layer's strikes",
           S + "layers/guard.py", "            if found is None:\n                self.strikes[name] = 0\n",
           "            if found is None:\n                pass\n", LAYER_TESTS),
    Mutant("guard-blames-a-nonfinite-input", "a layer whose input was already inf/NaN is blamed for its output",
           S + "layers/guard.py", "~amax.isfinite() & x_amax.isfinite()", "~amax.isfinite()",
           LAYER_TESTS),
    Mutant("guard-backward-ignores-scale", "a backward overflow at a high loss scale moves a layer",
           S + "layers/guard.py", "elif scale_used <= th.backward_scale and (", "elif (",
           LAYER_TESTS),
    Mutant("guard-blames-a-nonfinite-output-gradient",
           "a layer whose output gradient was already inf/NaN is blamed for its input gradient",
           S + "layers/probes.py", "(finite_grad_out > 0) & ~amax.isfinite()", "~amax.isfinite()",
           LAYER_TESTS),
    Mutant("guard-blames-a-weight-gradient-of-a-nan-input",
           "a layer is blamed for a NaN weight gradient made from its NaN input",
           S + "layers/guard.py", "math.isfinite(row[GRAD_OUT] + row[IN])", "math.isfinite(row[GRAD_OUT])",
           LAYER_TESTS),
    Mutant("guard-ignores-saturation", "fp8 saturation is not a signal",
           S + "layers/guard.py", "        if saturated > th.saturated:", "        if False:", LAYER_TESTS),
    Mutant("guard-no-replay", "a guard's state loads without replaying its moves",
           S + "layers/guard.py", "        for move in self.moves:\n            set_layer_precision(",
           "        for move in ():\n            set_layer_precision(", LAYER_TESTS),
    Mutant("guard-probe-reads-grad-in-python", "the guard reads an output gradient in a Python hook",
           S + "layers/guard.py",
           "            return probes.ProbeOut.apply(out, token, self._bwd, index)",
           "            out.register_hook(lambda grad: probes.fold(self._bwd, index, GRAD_OUT, probes.amax_of(grad)))\n"
           "            return None", LAYER_TESTS + COMPILE_TESTS),
    # --- under torch.compile --------------------------------------------------------------------------
    Mutant("compile-recompiles-at-step-two", "a prepared model's first-forward flag is guarded on, compiled",
           S + "prepare/levels.py", "    if not torch.compiler.is_compiling():\n        if not state.checked:",
           "    if True:\n        if not state.checked:", COMPILE_TESTS),
    Mutant("compile-kept-backward-in-fp16", "a compiled backward runs kept modules under the region's autocast",
           S + "amp/compiled_backward.py",
           "    if not torch.compiler.is_compiling():\n        return False",
           "    if True:\n        return False", COMPILE_TESTS),
    Mutant("compile-sr-step-traced", "bf16-sr's optimizer step is traced in a compiled training step",
           S + "step/stochastic_rounding.py", "    step_eagerly(optimizer, handles)\n", "", COMPILE_TESTS),
    Mutant("compile-o2-stale-copies", "O2's compiled forward reads the copies without refreshing them",
           S + "prepare/o2_copies.py",
           "                params[name] = master.to(self.copies.dtype)",
           "                params[name] = self.copies.copies[id(master)]", COMPILE_TESTS),
    # --- block-scaled formats -------------------------------------------------------------------------
    Mutant("mx-block-one-off", "an MX block's scale is made from 31 of its 32 values",
           S + "fp8/block_formats.py", "    amax = x.abs().amax(-1, keepdim=True)\n",
           "    amax = x[..., 1:].abs().amax(-1, keepdim=True)\n", BLOCK_TESTS),
    Mutant("nv-block-one-off", "an NVFP4 block's scale is made from 15 of its 16 values",
           S + "fp8/block_formats.py", "    amax = x.abs().amax(-1)\n", "    amax = x[..., :-1].abs().amax(-1)\n",
           BLOCK_TESTS),
    Mutant("mx-rceil-rounds-down", "rceil's power-of-two scale is rounded down, not up (values clamp)",
           S + "fp8/block_formats.py", "torch.ceil(torch.log2(descale))", "torch.floor(torch.log2(descale))",
           BLOCK_TESTS),
    Mutant("mx-floor-rounds-up", "floor's power-of-two scale is one binade too large",
           S + "fp8/block_formats.py", "floor_log2 - _MAX_POW2[elem_dtype]", "floor_log2 + 1 - _MAX_POW2[elem_dtype]",
           BLOCK_TESTS),
    Mutant("e2m1-ties-up", "e2m1 rounds 1.25 up to 1.5 (ties away from the even code)",
           S + "fp8/block_formats.py", "+ (a > 1.25)", "+ (a >= 1.25)", BLOCK_TESTS),
    Mutant("nv-tiles-ignored", "16x16 tiles scale each row's block alone", S + "fp8/block_formats.py",
           "    if tile:\n        rows = t.shape[0]", "    if False:\n        rows = t.shape[0]", BLOCK_TESTS),
    Mutant("hadamard-one-operand", "the weight gradient's GEMM rotates one operand only",
           S + "fp8/block_gemm.py", "a, b = hadamard(a, 1), hadamard(b, 0)", "a, b = hadamard(a, 1), b", BLOCK_TESTS),
    Mutant("sr-noise-reused", "stochastic rounding draws the same noise every backward",
           S + "fp8/linear.py", "                ctx.noise[1] += 1", "                ctx.noise[1] += 0", BLOCK_TESTS),
    Mutant("nv-keep-last-ignored", "nvfp4 converts its last layers too", S + "fp8/conversion.py",
           "    if not config.kept_fraction or not candidates:", "    if True:", BLOCK_TESTS),
    Mutant("block-stats-count-values", "a block layer's saturation counts values, not blocks",
           S + "fp8/block_gemm.py", "saturated = ((amax * multiplier) > top).float().mean()",
           "saturated = ((blocks.abs() * multiplier.unsqueeze(-1)) > top).float().mean()", BLOCK_TESTS),
    Mutant("plan-block-below-floor", "the plan gives a layer a block format whose SQNR is below the floor",
           S + "layers/choice.py", "            held = m.sqnr_db[p] >= floor_db", "            held = True",
           ("tests/layers/test_block_plan.py",)),
    Mutant("guard-ladder-skips-mxfp8", "the guard moves an nvfp4 layer straight to fp8",
           S + "layers/ladder.py", "    P.NVFP4: P.MXFP8,", "    P.NVFP4: P.FP8_TENSORWISE,",
           ("tests/layers/test_guard.py",)),
    Mutant("block-counter-not-loaded", "a checkpoint's rounding counter is dropped on load",
           S + "fp8/conversion.py", "key.rsplit(\".\", 1)[1] not in scaling._buffers:",
           "key.rsplit(\".\", 1)[1] not in scaling._buffers or key.endswith(\"noise\"):", BLOCK_TESTS),
    # --- fp8 linears ----------------------------------------------------------------------------------
    Mutant("fp8-records-non-finite-amax", "delayed scaling records the inf amax of an overflowed fp16 step",
           S + "fp8/linear.py", "torch.where(now.isfinite(), now, 0.0)", "now", FP8_TESTS),
    Mutant("fp8-recompute-advances", "each call of a delayed layer (a recompute too) rolls the history",
           S + "fp8/linear.py",
           "            pending[role] = torch.maximum(pending[role], torch.where(now.isfinite(), now, 0.0))",
           "            pending[role] = torch.maximum(pending[role], torch.where(now.isfinite(), now, 0.0))\n"
           "            history.copy_(torch.roll(history, 1, dims=1))", FP8_TESTS),
    Mutant("fp8-no-cuda-shape-rule", "misaligned linears are converted (CUDA would reject their GEMMs)",
           S + "fp8/conversion.py", "    if misaligned:\n", "    if False:\n", FP8_TESTS),
    Mutant("fp8-no-padding", "the weight gradient's token dim is not padded to 16",
           S + "fp8/gemm.py", "    extra = -a.shape[1] % ALIGN", "    extra = 0", FP8_TESTS),
    Mutant("fp8-head-converted", "the output head is converted by default",
           S + "fp8/conversion.py", "if name == head and not config.convert_head:",
           "if name == head and config.convert_head:", FP8_TESTS),
    Mutant("fp8-ignores-autocast", "an fp8 layer computes in its input's dtype under autocast",
           S + "fp8/linear.py", "    if torch.is_autocast_enabled(device_type):\n        category",
           "    if False:\n        category", FP8_TESTS),
    Mutant("fp8-bf16-history", "O2 stores the amax histories in bf16",
           S + "prepare/levels.py",
           "            if isinstance(module, Fp8Scaling):  # amax histories stay fp32\n                continue\n",
           "", FP8_TESTS),
    Mutant("fp8-drops-foreign-state-never", "a bf16 model cannot load a delayed-scaling checkpoint",
           S + "fp8/conversion.py", "            del state_dict[key]", "            pass", FP8_TESTS),
    Mutant("fp8-stats-unsorted", "diagnose lists fp8 layers in model order, not worst first",
           S + "observe/fp8_diagnostics.py", "    return sorted(reports, key=lambda r: r.sqnr)",
           "    return reports", FP8_TESTS),
    Mutant("fp8-rowwise-no-power-of-two", "rowwise scales are not rounded to powers of two",
           S + "fp8/gemm.py", "    if power_of_two:  #", "    if False:  #", FP8_TESTS),
    # --- what a new user met -------------------------------------------------------------------------------
    Mutant("plan-fp16-unscaled", "the per-layer plan scores fp16 without the loss scale it trains behind",
           S + "layers/plan.py", "fp16_scale if p is LayerPrecision.FP16 else 1.0", "1.0", LAYER_TESTS),
    Mutant("plan-ignores-noise", "a layer moves for a speed-up within its timings' noise",
           S + "layers/choice.py", "need = max(min_speedup, 1.0 + m.noise)", "need = min_speedup",
           LAYER_TESTS),
    Mutant("plan-never-repeats", "a layer's noisy timings are not repeated",
           S + "layers/plan.py", "(rep < _MAX_REPS and", "(False and", LAYER_TESTS),
    Mutant("plan-runs-a-slow-emulation-on", "fp8's SQNR runs on every layer however slow its emulation here",
           S + "layers/plan.py", "                dropped |= untimed\n", "", LAYER_TESTS),
    Mutant("plan-slow-emulation-from-the-next-layer", "a slow fp8 emulation still runs its other recipes on its layer",
           S + "layers/plan.py", "            if p in dropped:  # this layer's earlier", "            if False:  #",
           LAYER_TESTS),
    Mutant("tune-ignores-noise", "tune chooses a recipe faster than the default only within its noise",
           S + "tune/rounds.py", "need = max(min_speedup, 1.0 + (search.results[best].noise or 0.0))",
           "need = min_speedup", ("tests/tune/test_tune.py",)),
    Mutant("outer-autocast-told-every-call", "a prepared model warns of an outer autocast at every forward",
           S + "prepare/levels.py", "    state.told_outer = True\n", "", PREPARE_TESTS),
    Mutant("outer-autocast-silent", "a prepared model inside an autocast of another dtype says nothing",
           S + "prepare/levels.py", "        if not state.told_outer:", "        if False:",
           PREPARE_TESTS),
    Mutant("fp8-history-in-save-pretrained", "save_pretrained writes the delayed-scaling histories",
           S + "fp8/conversion.py", "    keep_out_of_save_pretrained(model)\n    sites.settle(model)\n    logger.info",
           "    sites.settle(model)\n    logger.info", ("tests/test_integrations.py",)),
    Mutant("fp8-unsaved-keys-stale", "a layer moved out of delayed scaling stays in the keys kept out",
           S + "fp8/conversion.py", "    ignore -= model.__dict__.get(_UNSAVED, set()) - now\n", "",
           ("tests/test_integrations.py",)),
    Mutant("layering-allows-upward", "the layering check lets a subsystem import a higher one",
           "tools/layering.py", "rank[theirs] > rank[mine] and", "rank[theirs] > rank[mine] + 99 and",
           ("tests/test_layering.py",)),
    Mutant("old-paths-gone", "a module's old flat path no longer imports (old pickles fail to load)",
           S + "_compat.py",
           "        sys.meta_path.append(_OldPaths())", "        pass", ("tests/test_old_pickles.py",)),
    Mutant("docs-name-a-moved-file", "the docs name a module file that is not there",
           "docs/architecture.md", "the per-thread state is in amp/thread_state.py",
           "the per-thread state is in amp/thread_local.py", ("tests/test_paths_named.py",)),
    Mutant("architecture-tree-incomplete", "docs/architecture.md's tree leaves a module out",
           "docs/architecture.md", "    reach.py                   gemm_reach:",
           "    reached.py                 gemm_reach:", ("tests/test_paths_named.py",)),
    Mutant("docs-name-an-old-path", "a docstring names a module by its old path",
           S + "fp8/config.py", "which is all the layer (``fp8/linear.py``) reads",
           "which is all the layer (``mixprec._src.fp8_linear``) reads", ("tests/test_paths_named.py",)),
    Mutant("old-paths-silent", "an old module path imports without a DeprecationWarning",
           S + "_compat.py", "        _warn(spec.name, new)\n", "", ("tests/test_old_pickles.py",)),
    Mutant("tune-never-repeats", "tune does not repeat a noisy round",
           S + "tune/rounds.py", "if any((t.noise(default) or 0.0) > timing.NOISY for t in running):",
           "if False:", ("tests/tune/test_tune.py",)),
    Mutant("in-backward-gradient-kept", "a parameter stepped in backward keeps its gradient",
           S + "step/step_in_backward.py", "                p.grad = None\n                self.stepped.add(id(p))",
           "                self.stepped.add(id(p))", IN_BACKWARD_TESTS),
    Mutant("in-backward-clipping-skipped", "the step in backward never scales a gradient by the clipping",
           S + "step/step_in_backward.py", "                    p.grad.mul_(scale.to(p.grad.device))",
           "                    pass", IN_BACKWARD_TESTS),
    Mutant("in-backward-previous-norm-ignored", "clipping in backward forgets the previous step's norm",
           S + "step/step_in_backward.py", "            bound = torch.maximum(bound, self.previous)",
           "            pass", IN_BACKWARD_TESTS),
    Mutant("in-backward-small-unclipped", "the small parameters are left to the optimizer's own step, unclipped",
           S + "step/step_in_backward.py",
           "        handles.append(optimizer.register_step_pre_hook(stepper.step_waiting))", "        pass",
           IN_BACKWARD_TESTS),
    Mutant("in-backward-small-not-counted", "the small parameters' gradients are left out of the norm",
           S + "step/step_in_backward.py", "            self.add_norm([p.grad])\n", "", IN_BACKWARD_TESTS),
    Mutant("pickle-optimizer-hooks", "a pickled prepared model takes its optimizer's hooks along (and fails)",
           S + "prepare/levels.py", 'return {**self.__dict__, "handles": list(self.on_modules)}',
           "return dict(self.__dict__)", ("tests/prepare/test_saving_whole.py",)),
    Mutant("pickle-o2-copies-by-old-id", "O2's loaded copies keyed by the copies' own ids",
           S + "prepare/o2_copies.py", "self.copies = {id(p): c for p, c in",
           "self.copies = {id(c): c for p, c in", ("tests/prepare/test_saving_whole.py",)),
    Mutant("policy-lists-unknown-ops", "the built-in policies list ops the installed torch lacks (import fails)",
           S + "policy/rules.py", "return frozenset(op for op in ops if op_names.exists(op))", "return frozenset(ops)",
           ("tests/policy/test_policy_grammar.py",)),
    Mutant("sr-noise-flat-index", "a (blocks, block) view takes the noise of its row's flat position alone",
           S + "step/sr_noise.py", "weyl = weyl + index.view(", "weyl = index.view(",
           ("tests/step/test_stochastic_rounding.py",)),
    Mutant("plan-foreach-per-parameter", "torch's foreach step planned as its for-loop (the GPU default missed)",
           S + "observe/param_bytes.py", "    if foreach:  # the denominators' list",
           "    if False:  # the denominators' list",
           ("tests/observe/test_memory_plan.py",)),
    Mutant("plan-foreach-lists-apart", "foreach's lists of two dtypes planned as never alive together",
           S + "observe/param_bytes.py", "*([] if sgd else [a + b for a, b in itertools.pairwise(sizes)])", "*[]",
           ("tests/observe/test_memory_plan.py",)),
    Mutant("plan-no-carried-denominator", "torch's for-loop Adam planned without the last parameter's denominator",
           S + "observe/memory_plan.py", "temporary += carried.get(cast(int, where), 0)", "temporary += 0",
           ("tests/observe/test_memory_plan.py",)),
    Mutant("peak-with-garbage-in-the-base", "the bench's peak starts from a level that holds uncollected garbage",
           "src/mixprec/bench/peak_memory.py", "        gc.collect()\n        if self.device.type",
           "        if self.device.type",
           ("tests/test_peak_memory.py",)),
    Mutant("in-backward-bucket-rest-uncounted", "what the bucket holds at the step is stepped, its norms left out",
           S + "step/step_in_backward.py", "        self.stepping = self._take_held()",
           "        self.stepping = list(self.held)", IN_BACKWARD_TESTS),
    Mutant("in-backward-bucket-rest-grads-kept", "the gradients the bucket held until the step outlive it",
           S + "step/step_in_backward.py", "            p.grad = None\n        self.stepping = []",
           "            pass\n        self.stepping = []", IN_BACKWARD_TESTS),
    Mutant("in-backward-bucket-never-full", "the bucket holds every gradient until the backward ends",
           S + "step/step_in_backward.py", "        if self.held_bytes >= self.bucket:", "        if False:",
           IN_BACKWARD_TESTS),
    Mutant("in-backward-bucket-small-squares-first", "the bucket's small parameters' squares are summed among the "
           "others'", S + "step/step_in_backward.py", "            self.small_squares.append(norms[len(large) :])",
           "            self.squares.append(norms[len(large) :])", IN_BACKWARD_TESTS),
    Mutant("in-backward-bucket-norms-split-wrong", "the bucket's one norm call gives a large weight's square to the "
           "small ones' sum", S + "step/step_in_backward.py",
           "            self.squares.append(norms[: len(large)])\n            self.small_squares.append(norms[len(",
           "            self.squares.append(norms[: len(large) - 1])\n"
           "            self.small_squares.append(norms[-1 + len(",
           IN_BACKWARD_TESTS),
    Mutant("in-backward-bucket-while-clipping", "clipping's gradients wait in the bucket (scaled by the norm of all)",
           S + "step/step_in_backward.py", "        self.bucket = BUCKET if max_norm is None and group is None else 0",
           "        self.bucket = BUCKET if group is None else 0", IN_BACKWARD_TESTS),
    Mutant("plan-bucket-ignored", "memory_plan counts one gradient in flight where the bucket holds several",
           S + "observe/memory_plan.py", "step_in_backward.BUCKET)) if bucket else in_flight + waiting",
           "step_in_backward.BUCKET)) if False else in_flight + waiting",
           ("tests/observe/test_memory_plan.py",)),
    Mutant("in-backward-accumulates", "a second backward before step() steps the parameters again",
           S + "step/step_in_backward.py", "        if id(p) in self.stepped:", "        if False:",
           IN_BACKWARD_TESTS),
    Mutant("fused-state-seed-offset", "the compiled step's last block rounds with the first block's noise",
           S + "optim/fused_adam.py", "seed = seed_at(offset) if", "seed = seed_at(0) if", FUSED_STATE_TESTS),
    Mutant("fused-state-fp8-zero", "the compiled fp8 step stores a tiny positive second moment as zero",
           S + "optim/fused_adam.py", "            scaled = torch.where((scaled > 0) & (scaled <= 2.0**-10), 2.0**-9, "
           "scaled)", "            pass", FUSED_STATE_TESTS),
    Mutant("fp8-cpu-gemm-on-onednn", "the CPU fp8 GEMM leaves oneDNN on (a scalar loop where the CPU has "
           "AVX512-FP16, summed in another order)", S + "fp8/gemm.py", "    torch._C._set_mkldnn_enabled(False)\n",
           "", ("tests/fp8/test_fp8_gemm.py",)),
    Mutant("cpu-state-lerp-unfused", "the CPU block kernel's lerp rounds its multiply before the add",
           S + "optim/kernels/vector_helpers.h", "? at::vec::fmadd(VecF(weight), end - start, start)",
           "? VecF(weight) * (end - start) + start", CPU_ADAM_TESTS),
    Mutant("cpu-state-noise-position", "the CPU block kernel rounds each block with the first block's noise",
           S + "optim/kernels/adam_quantized.cpp", "        write_vec(p, comp, k, next, rounding, seed);",
           "        write_vec(p, comp, k, next, rounding, seed - first * WEYL);", CPU_ADAM_TESTS),
    Mutant("cpu-state-second-moment-zero", "the CPU block kernel stores a tiny positive second moment as zero",
           S + "optim/kernels/adam_quantized.cpp",
           "            code = VecI::blendv(code, VecI(1), positive & (code == VecI(0)));",
           "", CPU_ADAM_TESTS),
    Mutant("cpu-state-fp8-second-moment-zero", "the CPU block kernel stores a tiny positive fp8 second moment as 0",
           S + "optim/kernels/adam_quantized.cpp",
           "                scaled = VecF::blendv(scaled, VecF(0x1p-9f), tiny);", "",
           CPU_ADAM_TESTS),
    Mutant("cpu-state-4bit-swapped", "the CPU block kernel unpacks 4-bit codes second value first",
           S + "optim/kernels/adam_quantized.cpp",
           "unpacked + 2 * j), _mm_unpacklo_epi8(high, rest));", "unpacked + 2 * j), _mm_unpacklo_epi8(rest, high));",
           CPU_ADAM_TESTS),
    Mutant("cpu-state-4bit-packed-swapped", "the CPU block kernel packs 4-bit codes second value in the high half",
           S + "optim/kernels/adam_quantized.cpp",
           "const __m128i pa = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(a, even), 4), _mm_srli_epi16(a, 8));",
           "const __m128i pa = _mm_or_si128(_mm_and_si128(a, even), _mm_slli_epi16(_mm_srli_epi16(a, 8), 4));",
           CPU_ADAM_TESTS),
    Mutant("sliced-noise-from-start", "each slice of a weight rounds stochastically with the tensor's first noise",
           S + "step/low_bit_state.py", "            0 if seed is None else moved(seed, first),",
           "            0 if seed is None else seed,",
           SLICED_TESTS),
    Mutant("sliced-eager-noise-from-start", "without the CPU kernel, each slice rounds with the tensor's first noise",
           S + "step/low_bit_state.py", "                writeback,\n                where,\n                first,\n",
           "                writeback,\n                where,\n                0,\n", SLICED_TESTS),
    Mutant("sliced-step-not-counted", "a weight stepped in slices never counts its step",
           S + "step/low_bit_state.py", '    optimizer.state[p]["step"] += 1', "    pass", SLICED_TESTS),
    Mutant("sliced-kept-dropped", "a layer called twice steps only its last call's gradient",
           S + "step/sliced_gradients.py", "                    part = self.kept[rows] + part",
           "                    pass", SLICED_TESTS),
    Mutant("sliced-clip-skipped", "slices of a weight are stepped unclipped",
           S + "step/sliced_gradients.py", "                    part.mul_(scale.to(part.device))",
           "                    pass", SLICED_TESTS),
    Mutant("sliced-input-grad-after-step", "the input's gradient is computed with the weight already stepped",
           S + "step/sliced_gradients.py", _BEFORE_STEP, "        layer.backward(grad2, x2)\n"
           + _BEFORE_STEP.removesuffix("        layer.backward(grad2, x2)\n"), SLICED_TESTS),
    Mutant("plan-slices-ignored", "memory_plan counts a sliced weight's whole gradient in flight",
           S + "observe/memory_plan.py", "            made = sliced.get(id(p), numel)", "            made = numel",
           SLICED_TESTS),
    Mutant("plan-backward-views-counted", "the backward timeline counts a view of a weight as memory made",
           S + "observe/backward_timeline.py", "if key not in self.made and key not in inputs and st.nbytes():",
           "if key not in self.made and st.nbytes():", PLAN_MEMORY_TESTS),
    Mutant("plan-backward-gradients-kept", "stepping in backward, the plan counts every gradient as backward makes it",
           S + "observe/memory_plan.py", "sizes = {n: None if config.step_in_backward else grad_bytes.get(i)",
           "sizes = {n: grad_bytes.get(i)", PLAN_MEMORY_TESTS),
    Mutant("plan-backward-ignored", "the plan's peak leaves out what backward makes (one gradient instead)",
           S + "observe/memory_plan.py", "held = self.largest_gradient if self.backward is None else self.backward",
           "held = self.largest_gradient", PLAN_MEMORY_TESTS),
    Mutant("cpu-state-kahan-dropped", "the CPU block kernel forgets the Kahan compensation",
           S + "optim/kernels/vector_helpers.h",
           "        store_vec(comp + k, sum - load_float(p + k));", "", CPU_ADAM_TESTS),
    Mutant("cpu-state-tail-noise", "the CPU block kernel's last, partial block rounds with its first block's noise",
           S + "optim/kernels/adam_quantized.cpp", "write_one(p, comp, k, next, w[i], rounding, seed);",
           "write_one(p, comp, k, next, w[i], rounding, seed - first * WEYL);", CPU_ADAM_TESTS),
    Mutant("cpu-norm-ragged-end", "the CPU square norm leaves out the values past its last full vector",
           S + "optim/kernels/square_norm.cpp",
           "    for (; i < last; ++i) { const float v = static_cast<float>(x[i]); sum += v * v; }", "",
           CPU_ADAM_TESTS),
    Mutant("kahan-compensation-dropped", "the Kahan write forgets what rounding dropped",
           S + "step/kahan.py", "    comp.copy_(s - p.float())", "    comp.zero_()", KAHAN_TESTS),
    Mutant("kahan-cast-elided", "the fused Kahan kernel rounds with a cast inductor elides (the compensation stays 0)",
           S + "step/kahan.py", "    rounded = bf16_nearest(s)", "    rounded = s.to(torch.bfloat16).float()",
           KAHAN_TESTS),
    Mutant("plan-step-count-left-out", "memory_plan leaves Adam's step counts out of the optimizer state",
           S + "observe/param_bytes.py", "    step = 4  # a 0-dim fp32 tensor", "    step = 0",
           PLAN_MEMORY_TESTS),
    Mutant("plan-compensation-left-out", "memory_plan leaves bf16-kahan's compensation out",
           S + "observe/param_bytes.py", "comp = numel * 2 if config.level is Level.BF16_KAHAN and low else 0",
           "comp = 0", PLAN_MEMORY_TESTS),
    Mutant("plan-weights-as-activations", "memory_plan counts the weights a layer saves as activations",
           S + "observe/activation_trace.py", "if key not in weights and key not in saved:", "if key not in saved:",
           PLAN_MEMORY_TESTS),
    Mutant("state-layout-unchecked", "codes of another state precision are read in the run's layout (4-bit as 8-bit)",
           S + "optim/moments.py", "    dtype, codes_len, scales_len = _layout(precision, capacity)\n",
           "    return\n    dtype, codes_len, scales_len = _layout(precision, capacity)\n", STATE_CHECKPOINT_TESTS),
    Mutant("quantized-checkpoint-into-fp32", "a quantized checkpoint loads into an fp32-state run as codes, no moments",
           S + "step/plan.py", "        state_dicts.dequantize_on_load(optimizer, handles)", "        pass",
           STATE_CHECKPOINT_TESTS),
    Mutant("bench-failure-loses-work", "a workload that raises ends mixprec bench with nothing written",
           "src/mixprec/bench/runner.py", "            except Exception as exc:  # the finished workloads stand",
           "            except KeyboardInterrupt as exc:  # the finished workloads stand", ("tests/test_bench.py",)),
    Mutant("tune-planning-spends-the-budget", "tune's memory planning is spent from budget_s, leaving no time",
           S + "tune/rounds.py", "return self.fit.seconds if self.fit is not None else 0.0", "return 0.0",
           MEMORY_BUDGET_TESTS),
    Mutant("tune-memory-budget-ignored", "tune chooses a recipe over its memory budget",
           S + "tune/rounds.py", "        if self.fit is not None and within_memory:", "        if False:",
           MEMORY_BUDGET_TESTS),
    Mutant("o2-copy-not-written-by-state-kernel", "the state precisions' list kernels leave O2's copy of a master "
           "unwritten in their vector pairs (the copies told they were written)",
           S + "optim/kernels/vector_helpers.h",
           "        if (rounding == 3 && comp != nullptr) store_pair(comp + k, next);", "", STEP_TESTS),
    Mutant("o2-copies-written-untold", "the copies the state precisions' lists wrote are not told so (the forward "
           "copies them again)", S + "step/low_bit_state.py",
           "    if copying is not None and copied:  # as their masters are now\n        copying.wrote(copied)\n",
           "", STEP_TESTS),
    Mutant("o2-copies-told-before-versions-move", "the copies the state precisions' lists wrote are told so before "
           "the masters' versions move (the forward copies them again)", S + "step/low_bit_state.py",
           "    versions.move_as_torch(group, params)\n    if copying is not None and copied:  # as their masters are "
           "now\n        copying.wrote(copied)\n",
           "    if copying is not None and copied:\n        copying.wrote(copied)\n"
           "    versions.move_as_torch(group, params)\n", STEP_TESTS),
    Mutant("square-norms-list-drops-a-chunk", "the norm list kernel adds a row's chunks but its first where it has "
           "several", S + "optim/kernels/square_norm.cpp",
           "        for (int64_t c = starts[i]; c < starts[i + 1]; ++c) total += partial[c];",
           "        for (int64_t c = starts[i] + (starts[i + 1] - starts[i] > 1); c < starts[i + 1]; ++c) "
           "total += partial[c];", IN_BACKWARD_TESTS),
    Mutant("own-sgd-copies-untold", "the O2 copies SGD's own step wrote are not told so (the forward copies them "
           "again)", S + "step/own_step.py", "            if copied and copies is not None:  # the copies the step",
           "            if False:  # the copies the step", ("tests/step/test_own_step.py",)),
    Mutant("own-sgd-copies-told-before-versions-move", "the O2 copies SGD's own step wrote are told so before the "
           "masters' versions move (the forward copies them again)", S + "step/own_step.py",
           "            stepped, copied = take(self, group, *lists)\n",
           "            stepped, copied = take(self, group, *lists)\n            if copied and copies is not None:\n"
           "                copies.wrote(copied)\n                copied = []\n", ("tests/step/test_own_step.py",)),
    Mutant("fused-fp8-cast-ties-away", "the fused fp8 cast rounds a normal value's ties up, not to even",
           S + "fp8/cast_kernels.py", "- 1) + lsb) >>", "- 1) + 0) >>", FUSED_CAST_TESTS),
    Mutant("fused-fp8-cast-subnormal-ties-away", "the fused fp8 cast rounds a subnormal value's ties up",
           S + "fp8/cast_kernels.py", "half + ((significand >> shift) & 1)", "half + 1", FUSED_CAST_TESTS),
    Mutant("fused-fp8-cast-nan-tile-dropped", "the fused fp8 cast's amax passes over a tile's NaN",
           S + "fp8/cast_kernels.py", 'tl.where(nan > 0, float("nan"), top)', "top", FUSED_CAST_TESTS),
    Mutant("fused-fp8-cast-no-saturation", "the fused fp8 cast does not clamp to the format's max",
           S + "fp8/cast_kernels.py", "tl.where(y > FP8_MAX, FP8_MAX,", "tl.where(y > FP8_MAX + 1e4, FP8_MAX,",
           FUSED_CAST_TESTS),
    Mutant("fused-fp8-cast-sign-lost", "the fused fp8 cast drops the sign bit",
           S + "fp8/cast_kernels.py", "tl.where(nan, NAN, code) | sign", "tl.where(nan, NAN, code)", FUSED_CAST_TESTS),
    Mutant("fused-fp8-amax-first-tile-row", "the fused fp8 cast's amax (and delayed scaling's record) reads the first "
           "row of tiles only", S + "fp8/fused_cast.py", "    return tiles.amax()  # NaN where",
           "    return tiles[0].amax()  # NaN where", FUSED_CAST_TESTS),
    Mutant("fused-fp8-cast-given-scale-ignored", "the fused fp8 cast scales by the operand's own amax where delayed "
           "scaling gave it a scale", S + "fp8/gemm.py", "fused_cast.cast(t, op.dtype, given,",
           "fused_cast.cast(t, op.dtype, None,", FUSED_CAST_TESTS),
    Mutant("sr-step-captured", "a bf16-sr step inside a CUDA graph capture goes on (its host noise baked in)",
           S + "step/sr_noise.py", "    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():",
           "    if False:", ("tests/step/test_stochastic_rounding.py",)),
    Mutant("sr-capture-refused-after-the-counts", "a bf16-sr step with quantized state counts its steps before it "
           "refuses a capture", S + "step/low_bit_state.py", "            sr_noise.refuse_capture()  # before anything",
           "            pass  # before anything", ("tests/step/test_stochastic_rounding.py",)),
    Mutant("fused-delayed-any-history-dtype", "the fused delayed scale folds an fp16 history", S + "fp8/linear.py",
           "        history.dtype in (torch.float32, torch.bfloat16)\n", "        True\n", FUSED_CAST_TESTS),
    Mutant("fused-delayed-scale-in-fp32", "the fused delayed scale divides in fp32 (on a GPU, Triton's approximate "
           "division)", S + "fp8/cast_kernels.py", "(((1.0 / clamped) * FP8_MAX) / MARGIN)",
           "(((1.0 / clamped.to(tl.float32)) * FP8_MAX) / MARGIN)", FUSED_CAST_TESTS),
    Mutant("fused-cast-scalar-stores", "the fused cast's codes are stored a byte at a time (the layout's stride of 1 "
           "hidden from Triton)", S + "fp8/cast_kernels.py", "tl.store(out + r[:, None] * o0 + c[None, :] * o1,",
           "tl.store(out + r[:, None] * (o0 * (rows // rows)) + c[None, :] * (o1 * (rows // rows)),", FUSED_CAST_TESTS),
    Mutant("fused-delayed-newest-is-second", "the fused delayed scale's most recent amax is the history's second",
           S + "fp8/cast_kernels.py", "past = tl.load(row) if MOST_RECENT", "past = tl.load(row + 1) if MOST_RECENT",
           FUSED_CAST_TESTS),
    Mutant("fused-delayed-margin-ignored", "the fused delayed scale leaves out the margin", S + "fp8/cast_kernels.py",
           "(((1.0 / clamped) * FP8_MAX) / MARGIN)", "((1.0 / clamped) * FP8_MAX)", FUSED_CAST_TESTS),
    Mutant("fused-delayed-history-passed-over", "the fused delayed scale takes the amax now though the history has one",
           S + "fp8/cast_kernels.py", "tl.where(past > 0, past, now)", "tl.where(past > 0, now, now)",
           FUSED_CAST_TESTS),
    Mutant("fused-delayed-records-non-finite", "the fused delayed scale records an inf or NaN amax",
           S + "fp8/cast_kernels.py", 'seen = tl.where((now == now) & (tl.abs(now) != float("inf")), now, 0.0)',
           "seen = now", FUSED_CAST_TESTS),
    Mutant("fused-delayed-record-overwrites", "the fused delayed scale's record replaces the step's pending amax",
           S + "fp8/cast_kernels.py", "tl.maximum(held, seen)", "seen", FUSED_CAST_TESTS),
    Mutant("fp8-output-gradient-read-twice", "the weight gradient's cast of the output gradient reads it for its "
           "amax again", S + "fp8/linear.py", "                scale_go = scales[0]  # the output",
           "                pass  # the output", FP8_TESTS),
    Mutant("fp8-given-scale-still-read", "a cast given its scale still reads the operand for its amax",
           S + "fp8/gemm.py", "amax_of(t, op, side) if given is None or record is not None else None",
           "amax_of(t, op, side)", FP8_TESTS),
)  # fmt: skip


def _copy(into: Path) -> None:
    for name in ("src", "tests", "tools", "docs", "benchmarks", "pyproject.toml", "README.md"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, into / name)


def run(mutant: Mutant, python: str, baseline: bool = False, without: tuple[str, ...] = ()) -> tuple[str, float]:
    """Apply ``mutant`` to a copy of the repository and run its tests: ``("killed" | "SURVIVED" | "STALE", s)``.

    ``baseline``: run its tests on the unchanged copy instead (they must pass, or every mutant would
    look killed: ``"killed"`` then means the tests are broken there). ``without``: test ids left out (a
    mutant that survives then was killed only by them).
    """
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mixprec-mutant-") as tmp:
        copy = Path(tmp)
        _copy(copy)
        path = copy / mutant.path
        text = path.read_text()
        if text.count(mutant.old) != 1:
            return "STALE", time.perf_counter() - start
        if not baseline:
            path.write_text(text.replace(mutant.old, mutant.new))
        env = {**os.environ, "PYTHONPATH": str(copy / "src")}
        command = [python, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", *mutant.tests]
        command += [f"--deselect={test}" for test in without]
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    if baseline and result.returncode != 0:  # what failed unmutated: the tests to fix first
        print(result.stdout[-3000:], file=sys.stderr)
    return ("killed" if result.returncode != 0 else "SURVIVED"), time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--without", action="append", default=[], metavar="TEST_ID",
                        help="leave this test out (repeatable): what survives was killed only by it")  # fmt: skip
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:32} {m.what}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown mutants: {', '.join(unknown)}; see --list", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.names] or list(MUTANTS)
    without = tuple(args.without)
    if without:  # only the mutants whose tests hold what is left out
        chosen = [m for m in chosen if any(t.split("::")[0] in m.tests for t in without)]
    for tests in dict.fromkeys(m.tests for m in chosen):  # each test group passes unmutated, in a copy
        first = next(m for m in chosen if m.tests == tests)
        outcome, _ = run(first, sys.executable, baseline=True, without=without)
        if outcome == "STALE":
            print(f"mutant {first.name} is stale: its text is not in {first.path} once", file=sys.stderr)
            return 1
        if outcome != "SURVIVED":
            print(f"the unmutated copy fails or lacks {', '.join(tests)}: fix that first", file=sys.stderr)
            return 1
    outcomes = []
    for mutant in chosen:
        outcome, seconds = run(mutant, sys.executable, without=without)
        outcomes.append(outcome)
        print(f"{outcome:9} {seconds:5.0f} s  {mutant.name:32} {mutant.what}", flush=True)
    killed = outcomes.count("killed")
    print(f"{killed} of {len(chosen)} mutants killed")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
