"""The catalogue of mistakes parity can name: id, what it means, how to fix it.

One entry per mistake.  ``diagnose.py`` holds how each is replayed; this module is pure data
(no torch), so reports, JUnit and baselines can name mistakes without loading the engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any


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
    LAYER_SHIFTED = "layer_shifted"
    EXPERT_SHIFTED = "expert_shifted"
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
    CONVERSION_UNEXPLAINED = "conversion_unexplained"


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
    Mistake(MistakeId.LAYER_SHIFTED, "checkpoint B's layer holds another layer of A (a shifted or repeated layer)",
            "fix the converter's layer index (an off-by-one, or a shard written from the wrong layer)"),
    Mistake(MistakeId.EXPERT_SHIFTED, "checkpoint B's expert holds another expert of A's same layer (experts "
            "exchanged, shifted or repeated)", "fix the converter's expert index (the order it numbers or stacks "
            "a layer's experts in, e.g. GGUF's *_exps tensors)"),
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
            "re-quantize from A's original weights with the format's own quantizer (llama-quantize, "
            "gguf.quants.quantize); the exporter chose the block scales itself"),
    Mistake(MistakeId.ZEROED_TENSOR, "every quantization code of checkpoint B's tensor is zero: the blocks keep "
            "their scales but none of A's values",
            "re-export the tensor: the quantizer wrote its codes empty (an unfilled buffer, a failed pack)"),
    Mistake(MistakeId.NONFINITE_SCALE, "a block scale of checkpoint B's quantized tensor is NaN or Inf: every "
            "value of that block is NaN or Inf", "re-quantize the tensor from A's weights: the block's float16 scale "
            "overflowed or was written corrupt"),
    Mistake(MistakeId.CONVERSION_UNEXPLAINED, "checkpoint B's layer computes another function than A's, and no "
            "known conversion mistake explains it",
            "compare the layer's tensors one by one (the report lists which differ beyond the conversion's bound)"),
]}


class _Readable(Mapping):
    """Reading a record by key too (``d["id"]``, ``d.get("fix")``, ``set(d)``): what reports held before they were
    typed, so code written against the dicts keeps working."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))


@dataclass
class Candidate(_Readable):
    """One mistake replayed for a failing layer, and how far the module's output is from that replay."""

    id: str
    detail: str
    distance: float


@dataclass
class Diagnosis(_Readable):
    """The known mistake that explains a failing layer (``LayerResult.diagnosis``), with the evidence."""

    id: str  # a MistakeId value
    message: str
    fix: str = ""
    distance: float | None = None  # the module's distance from the mistake's replay (None: a finding, no replay)
    reference_distance: float | None = None  # the module's distance from transformers
    candidates: list[Candidate] = field(default_factory=list)  # every replay tried; [] for findings


@dataclass
class Separability(_Readable):
    """Whether a run at its dtype and tolerance can tell one known mistake from a correct module on a layer."""

    id: str
    detail: str
    distance: float  # how far the mistake moves the output
    checked: bool  # the mistake is sure to fail at this dtype and tolerance
    message: str | None  # when not checked: why, and what to run instead


def diagnosis(mistake_id: MistakeId | str, distance: float | None, reference_distance: float | None,
              detail: str = "", candidates: list[Candidate] | None = None) -> Diagnosis:
    """A diagnosis as reports carry it, with the distances of the hypotheses replayed for it
    (``candidates``; none for findings that need no replay)."""
    mistake = MISTAKES[mistake_id]
    message = mistake.message + (f" ({detail})" if detail else "")
    return Diagnosis(str(mistake.id), message, mistake.fix, distance, reference_distance, list(candidates or []))


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
    MistakeId.GATE_UP_SWAPPED: "replay: diagnose.hypotheses, gate and up weights exchanged",
    MistakeId.MISSING_TRANSPOSE: "replay: diagnose.hypotheses (square weights); finding: target.shape_message",
    MistakeId.BIAS_DROPPED: "replay: diagnose.hypotheses, biases zeroed",
    MistakeId.LOW_PRECISION_COMPUTE: "replay: diagnose._low_precision_signature, the reference in half precision",
    MistakeId.INTERMEDIATE_SIZE_MISMATCH: "finding: target.shape_message, d_ff differs from the checkpoint's",
    MistakeId.SHAPE_MISMATCH: "finding: target.shape_message, another shape disagreement",
    MistakeId.UNEXPLAINED: "finding: diagnose.diagnose, no replay within the tolerance",
    MistakeId.GATE_UP_EXCHANGED: "replay (compare): A's layer with gate and up exchanged",
    MistakeId.GATE_UP_REORDERED: "replay (compare): A's gate and up fused in one layout and read in the other; "
                                 "replay: diagnose.hypotheses, one expert's gate and up read in the other layout",
    MistakeId.TENSOR_TRANSPOSED: "replay (compare): A's tensor transposed; finding: B's shape is A's reversed",
    MistakeId.LAYER_SHIFTED: "replay (compare): A's neighbouring layers, each in turn",
    MistakeId.EXPERT_SHIFTED: "replay (compare): A's other experts of the same layer, each in turn",
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
                               "quantizer chooses for A's values in that block",
    MistakeId.ZEROED_TENSOR: "finding (compare): every code of B's quantized tensor is zero, read from its blocks",
    MistakeId.NONFINITE_SCALE: "finding (compare): a NaN/Inf block scale in B's quantized tensor, read from its blocks",
    MistakeId.CONVERSION_UNEXPLAINED: "finding (compare): no conversion replay within the tolerance",
}
