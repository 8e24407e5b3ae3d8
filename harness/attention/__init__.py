"""The attention path: HunyuanImage-3's structured DiT mask and the kernels that must honour it.

layout      AttentionLayout (text prefix, image span, special rows; prefill or denoise) + seed layouts
masks       the mask rules as seams (span_bounds, causal_mask, image_span_mask, special_row_visibility,
            visibility, build_mask, causal_only)
contract    the seed's formula as an independent oracle; verifier (mismatches, density, histogram, span)
capture     npz capture I/O in the seed's format and the deterministic synthetic generator
reference   the kernel signature, masked SDPA (reference) and the mask-free approximation
decomposed  causal rows / span rows, concatenated (seam: split_rows)
flex        flex_attention with mask_mod + BlockMask
padded      block-padded to multiples of 128 (seam: pad_mask)
kernels     the kernel registry: GQA claims, computed pairs, launch facts
primitives  the SDPA / flex launches every kernel makes; spy records them
parity      compare_kernel and the contract verdicts (used by the CPU catalogue and the GPU tier)
"""
