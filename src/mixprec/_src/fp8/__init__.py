"""fp8: linears that compute their GEMMs in fp8 or in a block-scaled format (MXFP8, NVFP4).

Owns the recipes and their settings (``config``), the scaled GEMMs (``gemm``), eager CUDA's fused tensorwise
cast (``fused_cast``, its Triton kernels in ``cast_kernels``), the block-scaled
formats' casts (``block_formats``) and their emulated GEMMs (``block_gemm``), the layer's
forward and its scaling state (``linear``), converting a model's linears (``conversion``) and
all-gathering fp8 weights under FSDP2 (``all_gather``).
May import: the base modules, ``policy`` and ``amp``.
"""
