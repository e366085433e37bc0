"""The catalogue of mistakes parity can name: id, what it means, how to fix it.

One entry per mistake.  ``diagnose.py`` holds how each is replayed; this module is pure data
(no torch), so reports, JUnit and baselines can name mistakes without loading the engine.  What a run
found (the replays tried, the diagnosis with its evidence) are the records in ``records.py``;
``diagnosis`` here makes one from an id, with the catalogue's message and fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from parity.definitions.records import Candidate, Diagnosis


class MistakeId(StrEnum):
    """Every diagnosis id (stable: JSON consumers match on them)."""

    INPUT_MUTATED = "input_mutated"
    GLOBAL_STATE_MODIFIED = "global_state_modified"
    OTHER_LAYERS_WEIGHTS = "other_layers_weights"
    NONFINITE_OUTPUT = "nonfinite_output"
    DROPOUT_ACTIVE = "dropout_active"
    GELU_EXACT_INSTEAD_OF_TANH = "gelu_exact_instead_of_tanh"
    GELU_TANH_INSTEAD_OF_EXACT = "gelu_tanh_instead_of_exact"
    QUICK_GELU = "quick_gelu"
    SILU_INSTEAD_OF_GELU = "silu_instead_of_gelu"
    GELU_INSTEAD_OF_SILU = "gelu_instead_of_silu"
    WRONG_ACTIVATION = "wrong_activation"
    ACTIVATION_SPARSITY_MISSING = "activation_sparsity_missing"
    GATE_UP_SWAPPED = "gate_up_swapped"
    MISSING_TRANSPOSE = "missing_transpose"
    BIAS_DROPPED = "bias_dropped"
    LOW_PRECISION_COMPUTE = "low_precision_compute"
    INTERMEDIATE_SIZE_MISMATCH = "intermediate_size_mismatch"
    SHAPE_MISMATCH = "shape_mismatch"
    UNEXPLAINED = "unexplained"
    # conversion mistakes: a checkpoint B judged against the checkpoint A it was made from (`parity compare A B`)
    GATE_UP_EXCHANGED = "gate_up_exchanged"
    GATE_UP_REORDERED = "gate_up_reordered"
    TENSOR_TRANSPOSED = "tensor_transposed"
    ROWS_PERMUTED = "rows_permuted"
    COLUMNS_PERMUTED = "columns_permuted"
    LAYER_SHIFTED = "layer_shifted"
    EXPERT_SHIFTED = "expert_shifted"
    ROUTER_ROWS_PERMUTED = "router_rows_permuted"
    BLOCK_TENSOR_CHANGED = "block_tensor_changed"
    TENSOR_SCALED = "tensor_scaled"
    SIGN_FLIPPED = "sign_flipped"
    TENSOR_TRUNCATED = "tensor_truncated"
    ZERO_FILLED = "zero_filled"
    CONSTANT_TENSOR = "constant_tensor"
    CAST_OVERFLOW = "cast_overflow"
    NONFINITE_VALUES = "nonfinite_values"
    CONFIG_CHANGED = "config_changed"
    LAYER_MISSING = "layer_missing"
    TENSOR_MISSING = "tensor_missing"
    BYTES_REINTERPRETED = "bytes_reinterpreted"
    QUANTIZATION_EXCEEDS_STEP = "quantization_exceeds_step"
    VALUE_CORRUPTED = "value_corrupted"
    GRID_TOO_COARSE = "grid_too_coarse"
    ZEROED_TENSOR = "zeroed_tensor"
    NONFINITE_SCALE = "nonfinite_scale"
    FP8_SCALE_INVERTED = "fp8_scale_inverted"
    FP8_SCALES_TRANSPOSED = "fp8_scales_transposed"
    FP8_BLOCK_SIZE_WRONG = "fp8_block_size_wrong"
    BNB_CODE_BOOK_WRONG = "bnb_code_book_wrong"
    BNB_BLOCK_SIZE_WRONG = "bnb_block_size_wrong"
    BNB_DOUBLE_QUANT_NOT_UNDONE = "bnb_double_quant_not_undone"
    # MLX-LM affine-quantized safetensors (parity.sources.mlx_quantized, engine.compare.mlx_grid)
    MLX_GROUP_SIZE_WRONG = "mlx_group_size_wrong"
    MLX_BITS_MISMATCHED = "mlx_bits_mismatched"
    MLX_SCALES_TRANSPOSED = "mlx_scales_transposed"
    MLX_SCALES_BIASES_EXCHANGED = "mlx_scales_biases_exchanged"
    MLX_MODE_WRONG = "mlx_mode_wrong"
    FP4_SCALE_POWER_OFF = "fp4_scale_power_off"
    ZERO_POINT_OFF_BY_ONE = "zero_point_off_by_one"
    PACKED_ORDER_WRONG = "packed_order_wrong"
    G_IDX_IGNORED = "g_idx_ignored"
    GROUP_BITS_MISMATCHED = "group_bits_mismatched"
    GROUP_SIZE_WRONG = "group_size_wrong"
    GROUP_SCALES_TRANSPOSED = "group_scales_transposed"
    QUANTIZED_MODULE_NOT_STATED = "quantized_module_not_stated"
    QUANTIZED_MODULE_STORED_PLAIN = "quantized_module_stored_plain"
    CONVERSION_UNEXPLAINED = "conversion_unexplained"
    # routing mistakes of a whole mixture-of-experts block (engine.routing_replays: each replayed on transformers' own)
    ROUTER_SIGMOID_INSTEAD_OF_SOFTMAX = "router_sigmoid_instead_of_softmax"
    ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID = "router_softmax_instead_of_sigmoid"
    ROUTER_TOPK_BEFORE_SOFTMAX = "router_topk_before_softmax"
    ROUTER_SOFTMAX_BEFORE_TOPK = "router_softmax_before_topk"
    ROUTER_RENORMALIZATION_MISSING = "router_renormalization_missing"
    ROUTER_RENORMALIZATION_ADDED = "router_renormalization_added"
    SELECTION_BIAS_IN_WEIGHTS = "selection_bias_in_weights"
    SELECTION_BIAS_MISSING = "selection_bias_missing"
    ROUTED_SCALING_DROPPED = "routed_scaling_dropped"
    ROUTER_SCORE_ON_OUTPUT = "router_score_on_output"
    ROUTER_SCORE_ON_INPUT = "router_score_on_input"
    SHARED_EXPERT_MISSING = "shared_expert_missing"
    SHARED_EXPERT_GATE_MISSING = "shared_expert_gate_missing"
    SHARED_EXPERT_GATE_AFTER_SUM = "shared_expert_gate_after_sum"
    BLOCK_RESIDUAL_INCLUDED = "block_residual_included"
    ROUTER_WRONG_TOP_K = "router_wrong_top_k"
    EXPERTS_EXCHANGED = "experts_exchanged"
    SWIGLU_CLAMP_MISSING = "swiglu_clamp_missing"
    SWIGLU_ALPHA_MISSING = "swiglu_alpha_missing"
    SWIGLU_UP_PLUS_ONE_MISSING = "swiglu_up_plus_one_missing"
    GATE_UP_INTERLEAVING_MISREAD = "gate_up_interleaving_misread"


@dataclass(frozen=True)
class Mistake:
    id: MistakeId
    message: str
    fix: str


MISTAKES = {m.id: m for m in [
    Mistake(MistakeId.INPUT_MUTATED, "the module changes its input tensor in place",
            "do not modify the input (x.zero_(), x.clamp_(), F.silu(x, inplace=True), x += ...): "
            "in a model the caller's tensor (the residual stream) would be corrupted; "
            "compute on a copy or use the out-of-place op"),
    Mistake(MistakeId.OTHER_LAYERS_WEIGHTS, "the target holds another layer's weights (an export of one layer "
            "checked as another)", "check the layer the graph was exported from (--layer N), or export this one"),
    Mistake(MistakeId.GLOBAL_STATE_MODIFIED,
            "the module changed torch's global state, which the reference (and every other model) depends on",
            "do not replace functions of torch / torch.nn.functional / transformers.activations and do not call "
            "torch.set_default_dtype or set_grad_enabled in a module; parity restored them, the layer fails"),
    Mistake(MistakeId.NONFINITE_OUTPUT, "the module's output holds NaN or Inf where transformers' output is finite",
            "look for a division by zero, log/sqrt of a negative, an overflow in a low-precision dtype, or an "
            "uninitialised parameter (torch.empty) the mapping does not fill"),
    Mistake(MistakeId.DROPOUT_ACTIVE,
            "the module's output changes between two identical runs: dropout is active at inference",
            "call model.eval() before comparing, or build the FFN with dropout=0"),
    Mistake(MistakeId.GELU_EXACT_INSTEAD_OF_TANH,
            "exact (erf) GELU where the checkpoint expects the tanh approximation",
            "use the tanh GELU: nn.GELU(approximate='tanh') or parity.ffn.GELU (HF gelu_new / gelu_pytorch_tanh)"),
    Mistake(MistakeId.GELU_TANH_INSTEAD_OF_EXACT,
            "tanh-approximated GELU where the checkpoint expects the exact (erf) GELU",
            "use nn.GELU() (exact)"),
    Mistake(MistakeId.QUICK_GELU, "x*sigmoid(1.702x) (quick GELU) used in place of GELU",
            "use the GELU variant the checkpoint was trained with"),
    Mistake(MistakeId.SILU_INSTEAD_OF_GELU,
            "SiLU where the checkpoint expects GELU (a GeGLU checkpoint in a SwiGLU module?)",
            "use GeGLU / the tanh GELU for Gemma-style checkpoints"),
    Mistake(MistakeId.GELU_INSTEAD_OF_SILU,
            "GELU where the checkpoint expects SiLU (a SwiGLU checkpoint in a GeGLU module?)",
            "use SwiGLU / SiLU for LLaMA-style checkpoints"),
    Mistake(MistakeId.WRONG_ACTIVATION,
            "the module applies another activation than the checkpoint's FFN (ReLU for GELU, none at all, ...)",
            "apply the activation the checkpoint's config names (hidden_act / activation_function), as "
            "transformers' ACT2FN computes it"),
    Mistake(MistakeId.ACTIVATION_SPARSITY_MISSING,
            "the module skips the activation sparsity this layer's FFN applies to its gate (a Gaussian top-k: values "
            "below mean + std * Φ⁻¹(sparsity) zeroed before the activation)",
            "apply the layer's activation sparsity (its config's activation_sparsity_pattern[layer]) to the gate "
            "projection before the activation, as transformers' module does; build the FFN with its layer index"),
    Mistake(MistakeId.GATE_UP_SWAPPED,
            "gate and up projections are swapped: the activation is applied to the up branch",
            "load gate_proj (Meta w1, GGUF ffn_gate) into the gated branch and up_proj (w3, ffn_up) into the other"),
    Mistake(MistakeId.MISSING_TRANSPOSE, "a weight is used without the transpose its storage layout needs",
            "transpose Conv1D weights ([in, out]) when loading them into nn.Linear ([out, in])"),
    Mistake(MistakeId.BIAS_DROPPED, "checkpoint biases are not loaded (or the module has none)",
            "create the projections with bias=True and load the checkpoint's biases"),
    Mistake(MistakeId.LOW_PRECISION_COMPUTE, "the module computes in half precision",
            "compute in float32 (upcast the weights) when checking against the reference"),
    Mistake(MistakeId.INTERMEDIATE_SIZE_MISMATCH, "the module's d_ff differs from the checkpoint's intermediate_size",
            "build the FFN with hidden_dim = config.intermediate_size"),
    Mistake(MistakeId.SHAPE_MISMATCH, "a checkpoint tensor does not fit the module's parameter",
            "compare the module's parameter shapes with the checkpoint's (parity inspect)"),
    Mistake(MistakeId.UNEXPLAINED, "no known mistake explains this deviation",
            "compare the module's forward with transformers' MLP line by line"),
    Mistake(MistakeId.GATE_UP_EXCHANGED, "checkpoint B holds A's gate projection as up and A's up as gate",
            "fix the converter's name map: HF gate_proj = Meta w1 = GGUF ffn_gate, up_proj = w3 = ffn_up"),
    Mistake(MistakeId.GATE_UP_REORDERED, "a fused gate/up tensor is in the other layout: concatenated halves "
            "[gate; up] where transformers' module reads alternate rows (GPT-OSS: gate = rows 0::2, up = rows 1::2), "
            "or the reverse (checkpoint B written so, or a module under test reading it so)",
            "write and read the fused tensor in the layout transformers' module reads (interleave gate and up for "
            "GPT-OSS's gate_up_proj; concatenate them elsewhere)"),
    Mistake(MistakeId.TENSOR_TRANSPOSED, "a tensor of checkpoint B is the transpose of A's",
            "transpose it back in the converter (Conv1D [in, out] vs nn.Linear [out, in]; GGUF stores [out, in])"),
    Mistake(MistakeId.ROWS_PERMUTED, "a matrix of checkpoint B holds A's rows (its outputs) in another order, while "
            "the tensors it feeds are not reordered alike", "write the rows in A's order in the converter (a "
            "permutation of the hidden or intermediate units must be applied to every tensor that shares them, or "
            "to none)"),
    Mistake(MistakeId.COLUMNS_PERMUTED, "a matrix of checkpoint B holds A's columns (its inputs) in another order, "
            "while the tensors that feed it are not reordered alike", "write the columns in A's order in the "
            "converter (a permutation of the hidden or intermediate units must be applied to every tensor that "
            "shares them, or to none)"),
    Mistake(MistakeId.LAYER_SHIFTED, "checkpoint B's layer holds another layer of A (a shifted or repeated layer)",
            "fix the converter's layer index (an off-by-one, or a shard written from the wrong layer)"),
    Mistake(MistakeId.EXPERT_SHIFTED, "checkpoint B's expert holds another expert of A's same layer (experts "
            "exchanged, shifted or repeated)", "fix the converter's expert index (the order it numbers or stacks "
            "a layer's experts in, e.g. GGUF's *_exps tensors)"),
    Mistake(MistakeId.ROUTER_ROWS_PERMUTED, "checkpoint B's router rows are A's in another order, but its experts "
            "are not reordered alike: tokens reach other experts than A sends them to",
            "permute the router's rows and the experts with one order (or neither) in the converter"),
    Mistake(MistakeId.BLOCK_TENSOR_CHANGED, "a tensor of checkpoint B's MoE block outside its experts (the router, its "
            "selection bias, a shared expert's gate) is not A's as B's storage would hold it",
            "write that tensor unchanged (its name, orientation and dtype) in the converter"),
    Mistake(MistakeId.TENSOR_SCALED, "a tensor of checkpoint B is A's multiplied by a constant",
            "remove the extra scale in the converter (a norm folded in twice, a scale applied on the wrong side)"),
    Mistake(MistakeId.SIGN_FLIPPED, "a tensor of checkpoint B is A's with its sign flipped",
            "remove the negation in the converter"),
    Mistake(MistakeId.TENSOR_TRUNCATED, "a tensor of checkpoint B holds only part of A's values (the rest cut off "
            "or zero)", "write the whole tensor (a short write, a wrong shape or a slice in the converter)"),
    Mistake(MistakeId.ZERO_FILLED, "a tensor of checkpoint B is all zeros where A's is not",
            "the converter wrote an empty or uninitialised tensor: export it from A's weights"),
    Mistake(MistakeId.CONSTANT_TENSOR, "a tensor of checkpoint B holds one value everywhere where A's varies",
            "the converter wrote a placeholder or a fill value: export it from A's weights"),
    Mistake(MistakeId.CAST_OVERFLOW, "casting to checkpoint B's dtype overflowed: B holds Inf where A's values are "
            "finite", "keep these tensors in bfloat16 or float32 (float16 ends at 65504), or scale them first"),
    Mistake(MistakeId.NONFINITE_VALUES, "checkpoint B holds NaN/Inf where A's values (of the same dtype) are finite",
            "re-export the tensor from A: a same-dtype copy does not create NaN or Inf (a corrupt write, or a "
            "transform such as a scale computed in the wrong dtype)"),
    Mistake(MistakeId.CONFIG_CHANGED, "checkpoint B's config describes another FFN than A's: a model loading B "
            "computes another function, whatever its tensors hold",
            "write A's FFN settings (activation, d_ff) into B's config; the converter dropped or renamed them"),
    Mistake(MistakeId.LAYER_MISSING, "checkpoint B has no such layer: A's layer was not converted",
            "convert every layer (B's config or files stop early: a truncated export, or num_hidden_layers)"),
    Mistake(MistakeId.TENSOR_MISSING, "checkpoint B lacks a tensor of this layer's FFN",
            "re-export the layer: the converter skipped the tensor (a name the converter's map does not know)"),
    Mistake(MistakeId.BYTES_REINTERPRETED, "checkpoint B's tensor holds A's bytes read as another dtype "
            "(bfloat16 bits read as float16, or the reverse)",
            "convert the values (tensor.to(dtype)), do not reinterpret the buffer (view / frombuffer with the "
            "wrong dtype)"),
    Mistake(MistakeId.QUANTIZATION_EXCEEDS_STEP, "checkpoint B's quantized values are farther from A's than their "
            "block's own quantization step allows",
            "re-quantize from A's original weights (not from an already rounded or edited copy); check the "
            "quantizer's block layout"),
    Mistake(MistakeId.VALUE_CORRUPTED, "a value of checkpoint B is not what casting A's value to B's dtype gives: "
            "it is farther from it than one unit in the last place of B's dtype, which no cast or re-save produces",
            "re-export the tensor from A with a plain cast (tensor.to(dtype)); the file was edited or corrupted "
            "after the conversion (a flipped bit, a bad write, an in-place edit)"),
    Mistake(MistakeId.GRID_TOO_COARSE, "checkpoint B's quantized blocks use a coarser grid (a larger step) than "
            "the format's own quantizer chooses for A's values in those blocks: fewer bits of A are kept than the "
            "format claims",
            "re-quantize from A's original weights with the format's own quantizer (llama-quantize or "
            "gguf.quants.quantize, llm-compressor, GPTQModel, mlx.core.quantize, bitsandbytes); the exporter chose "
            "the block scales itself"),
    Mistake(MistakeId.ZEROED_TENSOR, "every quantization code of checkpoint B's tensor is zero: the blocks keep "
            "their scales but none of A's values",
            "re-export the tensor: the quantizer wrote its codes empty (an unfilled buffer, a failed pack)"),
    Mistake(MistakeId.NONFINITE_SCALE, "a block scale of checkpoint B's quantized tensor is NaN or Inf: every "
            "value of that block is NaN or Inf", "re-quantize the tensor from A's weights: the block's float16 scale "
            "overflowed or was written corrupt"),
    Mistake(MistakeId.FP8_SCALE_INVERTED, "checkpoint B's FP8 block scales are inverted: weight_scale_inv "
            "(compressed-tensors: weight_scale) holds 448 / block amax (the factor the quantizer multiplied A's "
            "values by) instead of its reciprocal, so dequantizing multiplies the codes by what it should divide "
            "them by",
            "write weight_scale_inv (weight_scale) = block amax / 448, the factor the codes are multiplied by to "
            "dequantize, not 448 / block amax"),
    Mistake(MistakeId.FP8_SCALES_TRANSPOSED, "checkpoint B's FP8 block scales are transposed: weight_scale_inv[i, j] "
            "belongs to block (j, i) of the weight",
            "write weight_scale_inv as [ceil(out / block), ceil(in / block)], in the weight's own [out, in] order"),
    Mistake(MistakeId.FP8_BLOCK_SIZE_WRONG, "checkpoint B's FP8 codes were quantized in blocks of another size than "
            "config.json's quantization_config.weight_block_size states: each scale is applied to other values "
            "than it was computed for",
            "quantize in the stated weight_block_size (partial edge blocks at the matrix's end, never an even "
            "split of each side), or state the block the exporter used"),
    Mistake(MistakeId.BNB_CODE_BOOK_WRONG, "checkpoint B's bitsandbytes 4-bit codes were written for one code book "
            "and are read with the other: NF4 codes read as FP4, or FP4 codes as NF4 (the quant_state's quant_type, "
            "or its quant_map, names the other table)",
            "state the quant type the codes were quantized with (quant_state.bitsandbytes__nf4 / __fp4 and "
            "quantization_config.bnb_4bit_quant_type), with that type's quant_map"),
    Mistake(MistakeId.BNB_BLOCK_SIZE_WRONG, "checkpoint B's bitsandbytes 4-bit absmax holds one value per block of "
            "another size than its quant_state's blocksize states: each absmax is applied to other values than it "
            "was computed for",
            "write the blocksize the weight was quantized with in its quant_state (bitsandbytes' default is 64)"),
    Mistake(MistakeId.BNB_DOUBLE_QUANT_NOT_UNDONE, "checkpoint B's bitsandbytes 4-bit absmax was double-quantized "
            "and written back without undoing it: its 8-bit codes dequantized without the stored offset, or the "
            "codes themselves taken for the absmax",
            "keep the nested_absmax, nested_quant_map and offset (QuantState.as_dict(packed=True)), or write "
            "dequantize_blockwise(absmax, state2) + offset as a plain float32 absmax"),
    Mistake(MistakeId.MLX_GROUP_SIZE_WRONG, "checkpoint B's MLX-quantized tensor was quantized in groups of another "
            "size than config.json's quantization (group_size, or the module's own entry) states: one scale and bias "
            "per group of that many input values, not the stated number",
            "state the group_size the tensor was quantized with (quantization.group_size, or a per-module entry for "
            "this module), or re-quantize it with the stated one (mlx_lm.convert -q --q-group-size)"),
    Mistake(MistakeId.MLX_BITS_MISMATCHED, "checkpoint B's MLX-quantized tensor holds codes of another width than "
            "config.json's quantization (bits, or the module's own entry) states (4-bit codes read as 8-bit or the "
            "reverse): every uint32 is unpacked into the wrong number of codes",
            "state the bits the tensor was quantized with (quantization.bits, or a per-module entry for this "
            "module), or re-quantize it with the stated width (mlx_lm.convert -q --q-bits)"),
    Mistake(MistakeId.MLX_SCALES_TRANSPOSED, "checkpoint B's MLX scales (and affine's biases) are transposed: stored "
            "[in / group_size, out] where MLX reads [out, in / group_size]",
            "write X.scales and X.biases as mlx.core.quantize returns them: one row per output, one column per "
            "group of group_size input values"),
    Mistake(MistakeId.MLX_SCALES_BIASES_EXCHANGED, "checkpoint B's MLX X.scales holds the groups' biases and "
            "X.biases their scales: every value dequantizes as bias x code + scale",
            "write mlx.core.quantize's outputs in its order: (weight, scales, biases)"),
    Mistake(MistakeId.FP4_SCALE_POWER_OFF, "checkpoint B's FP4 group scales are a power of two off the ones its "
            "codes were chosen for: an e8m0 exponent stored or read with bias 126 or 128 where the format's is 127 "
            "(transformers' MXFP4 dequantizer notes it), or an NVFP4 global scale doubled or halved; every value of "
            "the tensor is twice or half what it should be, and the halved grid clips A's largest values",
            "store each e8m0 exponent as floor(log2(scale)) + 127 and read it back the same way; write NVFP4's "
            "weight_global_scale as the quantizer used it (compressed-tensors' compress)"),
    Mistake(MistakeId.MLX_MODE_WRONG, "checkpoint B's MLX-quantized tensor is stored in another mode than "
            "config.json's quantization states: uint8 scales and no biases (a microscaled mode: mxfp4, mxfp8, "
            "nvfp4) where affine is stated, or a float scale and bias per group (affine) where a microscaled mode is; "
            "every value would be decoded on another grid",
            "state the mode the tensor was quantized with (quantization.mode, or the module's own entry), or "
            "re-quantize it in the stated one (mlx_lm.convert -q --q-mode)"),
    Mistake(MistakeId.ZERO_POINT_OFF_BY_ONE, "checkpoint B's integer zero points are one code off the ones its "
            "codes were quantized with: every value of a group moves by one step (GPTQ's v1 format stores each zero "
            "point minus one and its readers add one; a writer that skips or repeats that)",
            "write zero points as the format states: checkpoint_format 'gptq' (v1) stores zero - 1, 'gptq_v2' and "
            "AWQ store the zero itself; state the checkpoint_format the exporter used"),
    Mistake(MistakeId.QUANTIZED_MODULE_NOT_STATED, "checkpoint B stores this module quantized, but its config "
            "leaves it unquantized (no compressed-tensors group targets it, its ignore, modules_to_not_convert or "
            "llm_int8_skip_modules names it, or its MLX entry is false): a model loading B keeps it a plain Linear, "
            "which takes the module's codes for its weight or refuses them",
            "state the module as quantized (a config group's targets; out of the skip list; its MLX entry), or "
            "store it unquantized"),
    Mistake(MistakeId.QUANTIZED_MODULE_STORED_PLAIN, "checkpoint B stores this module unquantized, but its "
            "compressed-tensors config quantizes it (a config group targets it and ignore does not name it): a model "
            "loading B looks for its codes and scales, finds none, and does not run the weight B stores",
            "add the module to quantization_config.ignore, or store it quantized as its group states"),
    Mistake(MistakeId.PACKED_ORDER_WRONG, "checkpoint B's codes were packed in another order than its format "
            "reads them in: AWQ's in the linear order 0..7 within each int32 where AWQ's GEMM layout packs output "
            "columns 0 2 4 6 1 3 5 7, or an MLX mxfp4 block copied from ggml's MXFP4 (value j and j + 16 in byte j) "
            "where MLX reads values 2j and 2j + 1 from it, or FP4 codes with each byte's two nibbles exchanged: "
            "values are read in other places",
            "pack in the format's own order: qweight and qzeros in AWQ's (AutoAWQ's WQLinear_GEMM.from_linear), or "
            "state another format (GPTQ packs along the inputs, in linear order); an MLX tensor as "
            "mlx.core.quantize packs it, never ggml's blocks copied byte for byte"),
    Mistake(MistakeId.G_IDX_IGNORED, "checkpoint B's codes were quantized with act-order groups (each input column "
            "in the group GPTQ's ordering put it in), but its g_idx assigns each column the group of its position: "
            "columns are read with another group's scale and zero point",
            "store the g_idx the quantizer used (desc_act / act-order), or quantize without act-order"),
    Mistake(MistakeId.GROUP_BITS_MISMATCHED, "checkpoint B's packed codes hold another number of bits than "
            "config.json's quantization_config.bits states (4-bit codes read as 8, or the reverse)",
            "state the bits the exporter packed, or re-export with the stated bits"),
    Mistake(MistakeId.GROUP_SIZE_WRONG, "checkpoint B's scales were written for another group size than "
            "config.json's quantization_config.group_size states: each scale is applied to other values than it "
            "was computed for", "state the group_size the exporter used (-1: one group per row)"),
    Mistake(MistakeId.GROUP_SCALES_TRANSPOSED, "checkpoint B's group scales are transposed: [out, groups] where the "
            "format stores [groups, out] (compressed-tensors: the reverse)",
            "write the scales in the format's own order (GPTQ and AWQ: [groups, out]; pack-quantized: [out, groups])"),
    Mistake(MistakeId.CONVERSION_UNEXPLAINED, "checkpoint B's layer computes another function than A's, and no "
            "known conversion mistake explains it",
            "compare the layer's tensors one by one (the report lists which differ beyond the conversion's bound)"),
    Mistake(MistakeId.ROUTER_SIGMOID_INSTEAD_OF_SOFTMAX, "the router scores experts with a sigmoid where the "
            "block takes a softmax over them", "score with softmax(router_logits, dim=-1) as transformers' router "
            "does (the sigmoid belongs to DeepSeek-V3-style and Llama 4 routers)"),
    Mistake(MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID, "the router scores experts with a softmax where the "
            "block takes a sigmoid of each logit", "score with sigmoid(router_logits) (DeepSeek V3, Llama 4), "
            "each expert on its own, not a softmax across experts"),
    Mistake(MistakeId.ROUTER_TOPK_BEFORE_SOFTMAX, "the router takes the top-k of the raw logits and a softmax "
            "over those k, where the block takes the softmax over all experts first",
            "softmax over every expert's logit, then top-k of the probabilities (renormalise only where the "
            "block does: norm_topk_prob)"),
    Mistake(MistakeId.ROUTER_SOFTMAX_BEFORE_TOPK, "the router takes a softmax over all experts and then the top-k, "
            "where the block takes the top-k of the logits and a softmax over those k",
            "top-k of the router logits first, then softmax over the k chosen (GPT-OSS, Granite MoE)"),
    Mistake(MistakeId.ROUTER_RENORMALIZATION_MISSING, "the top-k routing weights are not renormalised to sum to 1 "
            "where the block renormalises them", "divide the k chosen weights by their sum (norm_topk_prob = true "
            "in the config; Mixtral always does)"),
    Mistake(MistakeId.ROUTER_RENORMALIZATION_ADDED, "the top-k routing weights are renormalised to sum to 1 where "
            "the block keeps them as scored", "keep the k chosen weights as the router scored them "
            "(norm_topk_prob = false in the config)"),
    Mistake(MistakeId.SELECTION_BIAS_IN_WEIGHTS, "the expert-selection bias (e_score_correction_bias) is added "
            "into the routing weights; it only chooses the experts",
            "choose experts by score + bias, but weight each chosen expert by its score alone "
            "(scores.gather(1, topk_indices))"),
    Mistake(MistakeId.SELECTION_BIAS_MISSING, "the experts are chosen without the expert-selection bias "
            "(e_score_correction_bias): by their scores alone",
            "choose experts (and score their groups) by score + bias, weighting each chosen expert by its score alone; "
            "load the bias at every width (DeepSeek-V3's inference Gate creates it only when dim == 7168, "
            "torchtitan's expert_bias only when load balancing is on)"),
    Mistake(MistakeId.ROUTED_SCALING_DROPPED, "the routed experts' weights are not multiplied by "
            "routed_scaling_factor", "multiply the (renormalised) top-k weights by config.routed_scaling_factor"),
    Mistake(MistakeId.ROUTER_SCORE_ON_OUTPUT, "the router score multiplies the expert's output where the block "
            "multiplies it into the expert's input", "scale each token's input to an expert by its router score "
            "before the expert (Llama 4), not the expert's output after it"),
    Mistake(MistakeId.ROUTER_SCORE_ON_INPUT, "the router score multiplies the expert's input where the block "
            "multiplies the expert's output", "run each expert on the unscaled token and multiply its output by the "
            "routing weight"),
    Mistake(MistakeId.BLOCK_RESIDUAL_INCLUDED, "the block adds its input to its output: the decoder layer's "
            "residual connection is inside it", "return the sparse block's output alone: "
            "the residual connection belongs to the decoder layer, and so does transformers' block"),
    Mistake(MistakeId.SHARED_EXPERT_MISSING, "the shared expert's output is not added to the routed experts'",
            "add the shared expert (applied to every token) to the sum of the routed experts"),
    Mistake(MistakeId.SHARED_EXPERT_GATE_MISSING, "the shared expert's sigmoid gate is not applied: its output is "
            "added ungated", "multiply the shared expert's output by sigmoid(shared_expert_gate(x)) before adding it"),
    Mistake(MistakeId.SHARED_EXPERT_GATE_AFTER_SUM, "the shared expert's sigmoid gate multiplies the sum of the "
            "routed and shared experts instead of the shared expert alone",
            "gate only the shared expert: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)"),
    Mistake(MistakeId.ROUTER_WRONG_TOP_K, "each token is routed to another number of experts than the block's "
            "top-k", "route each token to config.num_experts_per_tok experts"),
    Mistake(MistakeId.EXPERTS_EXCHANGED, "two experts are exchanged: a token the router sends to one runs the "
            "other's weights", "load expert e's weights into slot e, the one router row e scores (check the order "
            "the port numbers or stacks the experts in)"),
    Mistake(MistakeId.SWIGLU_CLAMP_MISSING, "the experts' gate and up are not clamped at swiglu_limit (no clamp, "
            "or a limit of 0)", "clamp the gate to at most limit and up to [-limit, limit] before the activation "
            "(GPT-OSS: swiglu_limit = 7, read from the config); inputs below the limit never show a missing clamp"),
    Mistake(MistakeId.SWIGLU_ALPHA_MISSING, "the experts' gate activation drops alpha: gate * sigmoid(gate) where "
            "the block computes gate * sigmoid(alpha * gate)", "use gate * sigmoid(config.swiglu_alpha * gate) "
            "(GPT-OSS: alpha = 1.702)"),
    Mistake(MistakeId.SWIGLU_UP_PLUS_ONE_MISSING, "the experts multiply the activation by up where the block "
            "multiplies it by (up + 1)", "compute (up + 1) * glu after clamping up (GPT-OSS)"),
    Mistake(MistakeId.GATE_UP_INTERLEAVING_MISREAD, "the experts' fused gate/up is read in the other layout: "
            "stored interleaved (GPT-OSS: gate = rows 0::2, up = rows 1::2) and read as two concatenated halves, or "
            "stored as halves and read interleaved",
            "read the fused tensor the way the block stores it (GPT-OSS: gate_up[..., ::2] is gate, "
            "gate_up[..., 1::2] is up, its bias the same way; Mixtral-style [gate; up] halves elsewhere)"),
]}


TOGETHER = " + "  # two mistakes made at once, named together: "router_softmax_instead_of_sigmoid + ..."


def together(*ids: MistakeId | str) -> str:
    """The id of mistakes made at once (a whole MoE block's replays composed, where no one alone reproduces it): each
    a catalogue id, joined by TOGETHER, so that a consumer matching on one finds it by splitting."""
    return TOGETHER.join(str(i) for i in ids)


def diagnosis(mistake_id: MistakeId | str, distance: float | None, reference_distance: float | None,
              detail: str = "", candidates: list[Candidate] | None = None) -> Diagnosis:
    """A diagnosis as reports carry it, with the distances of the hypotheses replayed for it
    (``candidates``; none for findings that need no replay).  An id of mistakes made at once (``together``) says
    each one's message and fix."""
    mistakes = [MISTAKES[MistakeId(part)] for part in str(mistake_id).split(TOGETHER)]
    message = ", and ".join(m.message for m in mistakes) + (f" ({detail})" if detail else "")
    fix = "; ".join(m.fix for m in mistakes)
    return Diagnosis(together(*(m.id for m in mistakes)), message, fix, distance, reference_distance,
                     list(candidates or []))


# Where each id comes from: a replay (diagnose.py replays it on transformers' MLP) or a finding (measured
# directly: the runs, the shapes, the state).  tests/test_architecture.py checks every id has an entry.
PRODUCED_BY: dict[MistakeId, str] = {
    MistakeId.INPUT_MUTATED: "finding: compare.judge, the target's copy of the input changed",
    MistakeId.GLOBAL_STATE_MODIFIED: "finding: session.run_layer, engine.check.guard saw torch's state change",
    MistakeId.OTHER_LAYERS_WEIGHTS: "finding: session.run_layer, an ONNX graph's initializers are another layer's "
                                    "checkpoint tensors",
    MistakeId.NONFINITE_OUTPUT: "finding: compare.judge, NaN/Inf in the target's output",
    MistakeId.DROPOUT_ACTIVE: "finding: compare.judge, two identical runs differ",
    MistakeId.GELU_EXACT_INSTEAD_OF_TANH: "replay: diagnose.hypotheses, the activation swapped",
    MistakeId.GELU_TANH_INSTEAD_OF_EXACT: "replay: diagnose.hypotheses, the activation swapped",
    MistakeId.QUICK_GELU: "replay: diagnose.hypotheses, the activation swapped",
    MistakeId.SILU_INSTEAD_OF_GELU: "replay: diagnose.hypotheses, the activation swapped",
    MistakeId.GELU_INSTEAD_OF_SILU: "replay: diagnose.hypotheses, the activation swapped",
    MistakeId.ACTIVATION_SPARSITY_MISSING: "replay: diagnose.hypotheses, the reference's activation_sparsity set to "
                                           "0 on a layer whose module has one",
    MistakeId.WRONG_ACTIVATION: "replay: diagnose.other_activations, every other ACT2FN activation in place of the "
                                "reference's, when no named mistake explains the layer",
    MistakeId.GATE_UP_SWAPPED: "replay: diagnose.hypotheses, gate and up weights exchanged (a whole MoE block: "
                               "routing_replays, every expert's gate and up exchanged in the fused gate_up_proj)",
    MistakeId.MISSING_TRANSPOSE: "replay: diagnose.hypotheses (square weights); finding: target.shape_message",
    MistakeId.BIAS_DROPPED: "replay: diagnose.hypotheses, biases zeroed",
    MistakeId.LOW_PRECISION_COMPUTE: "replay: diagnose._low_precision_signature, the reference in half precision; "
                                      "a whole block's: check.block_precision, transformers' block with its experts "
                                      "in the dtype the block was seen computing in",
    MistakeId.INTERMEDIATE_SIZE_MISMATCH: "finding: target.shape_message, d_ff differs from the checkpoint's",
    MistakeId.SHAPE_MISMATCH: "finding: target.shape_message, another shape disagreement",
    MistakeId.UNEXPLAINED: "finding: diagnose.diagnose, no replay within the tolerance",
    MistakeId.GATE_UP_EXCHANGED: "replay (compare): A's layer with gate and up exchanged",
    MistakeId.GATE_UP_REORDERED: "replay (compare): A's gate and up fused in one layout and read in the other; "
                                 "replay: diagnose.hypotheses, one expert's gate and up read in the other layout",
    MistakeId.TENSOR_TRANSPOSED: "replay (compare): A's tensor transposed; finding: B's shape is A's reversed",
    MistakeId.ROWS_PERMUTED: "replay (compare): A's rows in the order B's rows match them (each B row that is not "
                             "A's same row is matched to its nearest A row by cosine)",
    MistakeId.COLUMNS_PERMUTED: "replay (compare): A's columns in the order B's columns match them, as for the rows",
    MistakeId.LAYER_SHIFTED: "replay (compare): A's neighbouring layers, each in turn",
    MistakeId.EXPERT_SHIFTED: "replay (compare): A's other experts of the same layer, each in turn",
    MistakeId.ROUTER_ROWS_PERMUTED: "finding (compare, whole block): B's router rows match A's permuted; its experts "
                                    "do not",
    MistakeId.BLOCK_TENSOR_CHANGED: "finding (compare, whole block): B's tensor outside the experts differs from A's "
                                    "as stored in B's dtype",
    MistakeId.TENSOR_SCALED: "replay (compare): A's tensor times the least-squares factor fitted to B's",
    MistakeId.SIGN_FLIPPED: "replay (compare): A's tensor negated",
    MistakeId.TENSOR_TRUNCATED: "replay (compare): A's tensor with B's zero tail; finding: B's shape is smaller",
    MistakeId.ZERO_FILLED: "replay (compare): A's tensor zeroed",
    MistakeId.CONSTANT_TENSOR: "replay (compare): A's tensor replaced by B's constant",
    MistakeId.CAST_OVERFLOW: "finding (compare): Inf in B where A is finite",
    MistakeId.NONFINITE_VALUES: "finding (compare): NaN/Inf in B where A, of the same dtype, is finite",
    MistakeId.CONFIG_CHANGED: "finding (compare): B's config names another activation than A's",
    MistakeId.LAYER_MISSING: "finding (compare): A has the layer, B does not",
    MistakeId.TENSOR_MISSING: "finding (compare): B's layer lacks one of the FFN's tensors",
    MistakeId.BYTES_REINTERPRETED: "finding (compare): B's 16-bit patterns equal A's in the other 16-bit dtype",
    MistakeId.QUANTIZATION_EXCEEDS_STEP: "finding (compare): B's values against A's, per block's step from the file",
    MistakeId.VALUE_CORRUPTED: "finding (compare): a value of a cast or re-saved B more than one ulp of B's dtype "
                               "from A's value cast to that dtype",
    MistakeId.GRID_TOO_COARSE: "finding (compare): a block's step in B's file against the step the format's "
                               "quantizer chooses for A's values in that block; integer groups: a row's codes "
                               "against its groups' range (group_grid.coarse_rows), or on one level in k of it "
                               "where A rounded to nearest fills them all (group_grid.skipped_levels)",
    MistakeId.ZEROED_TENSOR: "finding (compare): every code of B's quantized tensor is zero, read from its blocks",
    MistakeId.NONFINITE_SCALE: "finding (compare): a NaN/Inf block scale in B's quantized tensor, read from its blocks",
    MistakeId.FP8_SCALE_INVERTED: "replay (compare): A quantized to FP8 blocks, its codes times 1 / each scale",
    MistakeId.FP8_SCALES_TRANSPOSED: "replay (compare): A quantized to FP8 blocks, the scale grid transposed "
                                     "(square grids); finding: B's scale grid is the stated one reversed",
    MistakeId.FP8_BLOCK_SIZE_WRONG: "replay (compare): A quantized in blocks splitting each side evenly, read in the "
                                    "stated blocks; finding: B's scale grid is another block size's",
    MistakeId.BNB_CODE_BOOK_WRONG: "replay (compare): A quantized by bitsandbytes to the other 4-bit type, its codes "
                                   "read with B's code book; finding: B's quant_map is the other type's",
    MistakeId.BNB_BLOCK_SIZE_WRONG: "finding (compare): B's absmax count is another block size's than its "
                                    "quant_state's blocksize",
    MistakeId.BNB_DOUBLE_QUANT_NOT_UNDONE: "replay (compare): A quantized by bitsandbytes with double quant, its "
                                           "absmax dequantized without the offset, or its 8-bit codes as the absmax",
    MistakeId.MLX_GROUP_SIZE_WRONG: "finding (compare): B's packed weight and scales fit another group size than "
                                    "the stated one at the stated bits",
    MistakeId.MLX_BITS_MISMATCHED: "finding (compare): B's packed weight and scales fit another bit width than the "
                                   "stated one at the stated group size",
    MistakeId.MLX_SCALES_TRANSPOSED: "finding (compare): B's scales are the stated grid reversed; replay: A "
                                     "quantized with mlx.core.quantize, a square grid transposed",
    MistakeId.MLX_SCALES_BIASES_EXCHANGED: "replay (compare): A quantized with mlx.core.quantize, dequantized "
                                           "with scales and biases exchanged",
    MistakeId.ZERO_POINT_OFF_BY_ONE: "replay (compare): A quantized on B's grid with zero points one code off, "
                                     "read with B's",
    MistakeId.QUANTIZED_MODULE_STORED_PLAIN: "finding (compare): a linear weight stored unquantized that "
                                             "compressed-tensors' match_targets gives a config group, not ignored",
    MistakeId.QUANTIZED_MODULE_NOT_STATED: "finding (compare): a module stored with codes and scales that its "
                                           "loader's own rule leaves unquantized (compressed-tensors' match_targets, "
                                           "transformers' should_convert_module, MLX's entry false)",
    MistakeId.PACKED_ORDER_WRONG: "replay (compare): A quantized on B's AWQ grid, packed in the linear order and "
                                  "read in AWQ's; or A quantized with mlx.core.quantize (mxfp4), its blocks in "
                                  "ggml's MXFP4 order read in MLX's; or A rounded onto B's FP4 groups, each "
                                  "byte's nibbles exchanged",
    MistakeId.FP4_SCALE_POWER_OFF: "replay (compare): A rounded onto B's FP4 groups at twice or half B's scale, "
                                   "read at B's",
    MistakeId.MLX_MODE_WRONG: "finding (compare): B's scales and biases are another mode's storage than the stated "
                              "mode's",
    MistakeId.G_IDX_IGNORED: "replay (compare): A quantized in the groups that fit its columns best, read with B's "
                             "g_idx",
    MistakeId.GROUP_BITS_MISMATCHED: "finding (compare): B's packed word counts against the stated bits",
    MistakeId.GROUP_SIZE_WRONG: "finding (compare): B's scale grid is another group size's",
    MistakeId.GROUP_SCALES_TRANSPOSED: "finding (compare): B's scale grid is the stated one reversed",
    MistakeId.CONVERSION_UNEXPLAINED: "finding (compare): no conversion replay within the tolerance",
    MistakeId.ROUTER_SIGMOID_INSTEAD_OF_SOFTMAX: "replay: engine.routing_replays, the router's softmax computed "
                                                 "as a sigmoid",
    MistakeId.ROUTER_SOFTMAX_INSTEAD_OF_SIGMOID: "replay: engine.routing_replays, the router's sigmoid computed "
                                                 "as a softmax",
    MistakeId.ROUTER_TOPK_BEFORE_SOFTMAX: "replay: engine.routing_replays, the router's top-k taken of its logits",
    MistakeId.ROUTER_SOFTMAX_BEFORE_TOPK: "replay: engine.routing_replays, the router's top-k taken of a softmax",
    MistakeId.ROUTER_RENORMALIZATION_MISSING: "replay: engine.routing_replays, the router's division by the top-k "
                                              "sum skipped (or norm_topk_prob off)",
    MistakeId.ROUTER_RENORMALIZATION_ADDED: "replay: engine.routing_replays, the router's weights divided by their "
                                            "sum (or norm_topk_prob on)",
    MistakeId.SELECTION_BIAS_IN_WEIGHTS: "replay: engine.routing_replays, the router's selection bias added to "
                                         "the gathered weights",
    MistakeId.SELECTION_BIAS_MISSING: "replay: engine.routing_replays, the selection bias held at 0 (and each group "
                                      "scored by its best expert, as DeepSeek-V3's inference Gate does without one); "
                                      "not where the bias is one value for every expert (it chooses nothing)",
    MistakeId.ROUTED_SCALING_DROPPED: "replay: engine.routing_replays, routed_scaling_factor set to 1",
    MistakeId.ROUTER_SCORE_ON_OUTPUT: "replay: engine.routing_replays, the block's experts run on unscaled "
                                      "input, their outputs scaled",
    MistakeId.ROUTER_SCORE_ON_INPUT: "replay: engine.routing_replays, the block's experts run on scaled input, "
                                     "one top-k rank at a time",
    MistakeId.BLOCK_RESIDUAL_INCLUDED: "check: engine.check.block_check, the block's output minus its input "
                                       "within tolerance of transformers' block",
    MistakeId.SHARED_EXPERT_MISSING: "replay: engine.routing_replays, the shared expert's output zeroed",
    MistakeId.SHARED_EXPERT_GATE_MISSING: "replay: engine.routing_replays, the shared expert's gate fully open",
    MistakeId.SHARED_EXPERT_GATE_AFTER_SUM: "replay: engine.routing_replays, the routed output times the shared "
                                            "expert's gate",
    MistakeId.ROUTER_WRONG_TOP_K: "replay: engine.routing_replays, the router's top_k set to k - 1 and k + 1",
    MistakeId.EXPERTS_EXCHANGED: "replay: engine.routing_replays, two experts' weights exchanged (the pairs "
                                 "among the experts the mismatching tokens use)",
    MistakeId.SWIGLU_CLAMP_MISSING: "replay: engine.routing_replays, the experts' limit set to infinity, and to 0 "
                                    "(one expert: diagnose.hypotheses, the same)",
    MistakeId.SWIGLU_ALPHA_MISSING: "replay: engine.routing_replays, the experts' alpha set to 1 (one expert: "
                                    "diagnose.hypotheses, the same)",
    MistakeId.SWIGLU_UP_PLUS_ONE_MISSING: "replay: engine.routing_replays, the experts' (up + 1) computed as up",
    MistakeId.GATE_UP_INTERLEAVING_MISREAD: "replay: engine.routing_replays, the experts' fused gate/up rearranged "
                                            "into the other layout (halves interleaved, or the reverse)",
}


def fit_diagnosis(found: list[tuple[MistakeId | str, str, float, float]], *, note: str = "") -> Diagnosis:
    """The diagnosis naming the closest of ``found`` (engine.routing_mistakes' ``Search.fits``: id, what the
    replay changes, its distance, the correct block's) with what its replay changes and ``note``; the
    others that fit equally said beside it, each a candidate with its distance."""
    first, detail, distance, reference = found[0]
    equally = "; ".join(f"equally {other}: {why}" for other, why, _, _ in found[1:])
    return diagnosis(first, distance, reference, detail + note + (f"; {equally}" if equally else ""),
                     [Candidate(str(mistake), why, fit) for mistake, why, fit, _ in found])
