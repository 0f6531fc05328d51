"""Step: the optimizer's step at a precision level, planned once from what prepare was asked for.

Owns the plan (``plan``: how the weight is written, how the state is stored, when the step runs, which
optimizer), bf16 stochastic rounding of the updates (``stochastic_rounding``, its noise ``sr_noise`` and its
compiled Adam(W) kernel ``sr_kernel``) and Kahan-compensated ones (``kahan``), quantized and bf16 optimizer
state in the optimizer's step (``low_bit_state``, ``bf16_state``; which optimizers can: ``state_checks``; in
state dicts: ``state_dicts``; what their list took at a weight's last step: ``taken_before``), step counts on
the host (``host_counts``), the weights' version counters after a one-call step (``versions``), the optimizer's
own Adam(W) and SGD of what the others leave, in one call on the CPU (``own_step``), and the step in backward
(``step_in_backward``, the norms it counts ``grad_norms``, ``sliced_gradients``). The kernels it runs are
``optim``'s.
May import: the base modules, ``gemms`` and ``optim``.
"""
