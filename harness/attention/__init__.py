"""The attention path: HunyuanImage-3's structured DiT mask and the kernels that must honour it.

layout      AttentionLayout (text prefix, image span, special rows; prefill or denoise) + seed layouts
masks       the mask rules as seams (span_bounds, causal_mask, image_span_mask, special_row_visibility,
            visibility, build_mask, causal_only)
contract    the seed's formula as an independent oracle; verifier (mismatches, density, histogram, span)
capture     npz capture I/O in the seed's format, the deterministic synthetic generator, the capture
            directory's checkpoint kind
reference   the kernel signature kernel(query, key, value, layout, *, scale=None), masked SDPA
            (reference) and the mask-free approximation (seam: resolve_scale, the scale every kernel uses)
decomposed  causal rows / span rows, concatenated (seam: split_rows)
flex        flex_attention with mask_mod + BlockMask at a block size (64, 128, ...)
padded      block-padded to multiples of a block size (seams: pad_mask, padded_length)
kernels     KernelSpec (GQA claim, computed pairs, launch proof, all at a block size) and register(),
            the entry point that fills harness.plugins.entry_points.ATTENTION_KERNELS / CHECKPOINT_KINDS
primitives  the SDPA / flex launches every kernel makes (seams: gqa_operands, launch_sdpa); spy records them
policies    tolerance policies from controls on stock code: fp32 floor, row-scaled low precision,
            two-sided [K_MIN, K_MAX] bounds
judge       compare_kernel (registered kernels, or the --impl under test) and the contract verdicts
"""
