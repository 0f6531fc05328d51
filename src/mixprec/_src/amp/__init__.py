"""amp: autocast as torch runs it, with mixprec's policies.

Owns the autocast region (``autocast``, ``region``), the dispatch kernel that casts each op's
inputs (``dispatch``), per-module rules (``module_rules``), activation checkpointing's replay of
the region (``checkpoint_replay``), ``custom_fwd``/``custom_bwd`` (``custom_function``) the
backward's precision under ``torch.compile`` (``compiled_backward``) and the per-thread state of it all
(``thread_state``).
May import: the base modules and ``policy``.
"""
