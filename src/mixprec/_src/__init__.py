"""mixprec's implementation. Import from ``mixprec``; nothing here is public.

The subsystems, lowest first; each may import those before it, never one after it
(``tests/test_layering.py`` checks it):

==========  ===========================================================================
(base)      the modules at this level: errors, dtypes, op names, casting, bound forwards,
            input checks, layouts, numerics, timing, sharding probes, per-thread state
gemms/      GEMM layers: their kinds (linear, Conv1D, attention projections, convolutions),
            the routed attention forward, the fused paths kept off, the FLOP count
policy/     what runs in which precision: op tables, ``Policy``, its grammar, interning
amp/        autocast: the region, the dispatch kernel, module rules, checkpoint replay
scaling/    the loss scaler: ``GradScaler``, its rule, unscaling, events, settings
fp8/        fp8 linears: config, GEMMs, the layer, conversion, FSDP2 all-gather
layers/     per-layer precision: ``set_layer_precision``, the per-layer plan, ``Guard``
optim/      optimizer state in low precision: the block-wise quantizer of moments
prepare/    ``prepare``'s levels: kept modules, O2's copies, bf16 stochastic rounding, memory
observe/    diagnose, the fp8 report, ``Monitor``, their tables and plots
tune/       ``Recipe`` and ``tune``
==========  ===========================================================================

Old module paths (pickles of earlier versions record them) live in ``_compat``: they import, and warn.
"""

from __future__ import annotations

from mixprec._src import _compat

_compat.install()
