"""ONNX's own backend node test vectors, run through lnn's importer and kernels.

The vectors are the single-node models and input/output tensors of onnx's backend test suite:
onnx/backend/test/data/node/test_*/ (model.onnx, test_data_set_0/input_*.pb, output_*.pb) when the
installed onnx wheel ships that folder, otherwise the same cases produced in memory by the onnx
package's case scripts (onnx.backend.test.case.node.<op>, the code that writes that folder; the
onnx 1.23 wheel ships the scripts but not the folder).

Adapter: a node test feeds weights as graph inputs; here every input after the first becomes an
initializer holding its test value, so the single node is an ordinary one-layer model for lnn-import.
The imported model runs on the NumPy reference backend and, when it imports, the Numba cpu backend;
outputs must match ONNX's stored outputs within rtol = atol = 1e-4.

Every case of a claimed op either runs and matches, or is listed in SKIPS with the reason; a skipped
case must be refused by the importer with an LnnError (so lnn never runs a graph it would get wrong).
"""

import importlib
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import numpy_helper  # noqa: E402

from lnn.formats.errors import LnnError  # noqa: E402
from lnn.formats.onnx_import import import_onnx  # noqa: E402
from lnn.runtime import backend_class  # noqa: E402

from conftest import runtime_devices  # noqa: E402

RTOL = ATOL = 1e-4

# ONNX op -> the onnx.backend.test.case.node module that makes its cases
CLAIMED_OPS = {
    "Conv": "conv", "MaxPool": "maxpool", "AveragePool": "averagepool", "GlobalAveragePool": "globalaveragepool",
    "GlobalMaxPool": "globalmaxpool",
    "Gemm": "gemm", "MatMul": "matmul", "Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh",
    "LeakyRelu": "leakyrelu", "Clip": "clip", "Softmax": "softmax", "BatchNormalization": "batch_normalization",
    "Flatten": "flatten", "Reshape": "reshape", "Dropout": "dropout", "Identity": "identity",
}

ELEMENTWISE = {"Relu", "Sigmoid", "Tanh", "LeakyRelu", "Clip", "Dropout"}

# Why a case cannot run as an lnn model. Each is refused by lnn-import with an error naming the node.
POOL_3D = "3-D pooling: lnn pools [N, C, T] and [N, C, H, W] only"
CEIL_MODE = "ceil_mode=1 makes the output one larger here; lnn's pooling rounds down (PyTorch's default)"
POOL_DILATION = "dilated pooling: lnn's pooling has no dilation"
PADS_OVER_HALF_KERNEL = "pads 2 around a 3-wide window: lnn (like PyTorch) pads pooling at most half the kernel"
SAME_ASYMMETRIC = "auto_pad SAME with an even kernel pads one side more than the other; lnn pads both sides alike"
TRAINING = "training mode (batch statistics or a random mask): lnn imports inference graphs"
SECOND_OUTPUT = "reads a second output (dropout mask, max-pool indices); lnn layers have one output"
CLIP_RANGE = "Clip to a range other than [0, 6] or [0, inf): lnn's clipping activations are relu6 and relu only"
NO_LAYER = "the node is the identity (Identity, Clip without bounds): it imports to no layer, and a model needs one"
RANK1 = "rank-1 input to a matrix product: an lnn model takes [N, features...]"
NOT_FLOAT32 = "integer input: lnn models take float32"
NOT_A_TENSOR = "the input is an optional or a sequence, not a tensor"
FLATTEN_AXIS = "Flatten on an axis other than 1: lnn's flatten keeps the batch and flattens the rest"
GEMM_TRANSPOSED_A = "transA=1: lnn's linear takes the input as rows [N, K]"
GEMM_MATRIX_BIAS = "a bias matrix [M, N] differs per batch row; lnn's linear has one bias per output"
MATMUL_BATCHED = "batched MatMul (rank > 2): lnn's linear takes [N, K]"
RESHAPE_NOT_FLATTEN = "a Reshape that is not a flatten to [N, -1]: lnn has no general reshape"
SOFTMAX_AXIS = "softmax over one axis of a rank-3 tensor: lnn's softmax takes [N, K]"

SKIPS = {
    "test_averagepool_3d_default": POOL_3D,
    "test_averagepool_3d_dilations_large_count_include_pad_is_0_ceil_mode_is_False": POOL_3D,
    "test_averagepool_3d_dilations_large_count_include_pad_is_0_ceil_mode_is_True": POOL_3D,
    "test_averagepool_3d_dilations_large_count_include_pad_is_1_ceil_mode_is_False": POOL_3D,
    "test_averagepool_3d_dilations_large_count_include_pad_is_1_ceil_mode_is_True": POOL_3D,
    "test_averagepool_3d_dilations_small": POOL_3D, 
    "test_maxpool_3d_default": POOL_3D, "test_maxpool_3d_dilations": POOL_3D,
    "test_maxpool_3d_dilations_use_ref_impl": POOL_3D,
    "test_maxpool_3d_dilations_use_ref_impl_large": POOL_3D,
    "test_averagepool_2d_ceil": CEIL_MODE, "test_averagepool_2d_ceil_last_window_starts_on_pad": CEIL_MODE,
    "test_maxpool_2d_ceil": CEIL_MODE, "test_maxpool_2d_ceil_output_size_reduce_by_one": CEIL_MODE,
    "test_averagepool_2d_dilations": POOL_DILATION, "test_maxpool_2d_dilations": POOL_DILATION,
    "test_averagepool_2d_pads": PADS_OVER_HALF_KERNEL,
    "test_averagepool_2d_pads_count_include_pad": PADS_OVER_HALF_KERNEL,
    "test_maxpool_2d_pads": PADS_OVER_HALF_KERNEL,
    "test_averagepool_2d_same_lower": SAME_ASYMMETRIC, "test_averagepool_2d_same_upper": SAME_ASYMMETRIC,
    "test_maxpool_2d_same_lower": SAME_ASYMMETRIC, "test_maxpool_2d_same_upper": SAME_ASYMMETRIC,
    "test_batchnorm_epsilon_training_mode": TRAINING, "test_batchnorm_example_training_mode": TRAINING,
    "test_training_dropout": TRAINING, "test_training_dropout_default": TRAINING,
    "test_training_dropout_default_mask": TRAINING, "test_training_dropout_mask": TRAINING,
    "test_training_dropout_zero_ratio": TRAINING, "test_training_dropout_zero_ratio_mask": TRAINING,
    "test_dropout_default_mask": SECOND_OUTPUT, "test_dropout_default_mask_ratio": SECOND_OUTPUT,
    "test_maxpool_with_argmax_2d_precomputed_pads": SECOND_OUTPUT,
    "test_maxpool_with_argmax_2d_precomputed_strides": SECOND_OUTPUT,
    "test_clip": CLIP_RANGE, "test_clip_default_max": CLIP_RANGE, "test_clip_example": CLIP_RANGE,
    "test_clip_inbounds": CLIP_RANGE, "test_clip_min_greater_than_max": CLIP_RANGE, "test_clip_outbounds": CLIP_RANGE,
    "test_clip_splitbounds": CLIP_RANGE,
    "test_identity": NO_LAYER, "test_clip_default_inbounds": NO_LAYER, "test_clip_default_inbounds_expanded": NO_LAYER,
    "test_matmul_1d_1d": RANK1, "test_matmul_1d_3d": RANK1,
    "test_clip_default_int8_inbounds": NOT_FLOAT32, "test_clip_default_int8_inbounds_expanded": NOT_FLOAT32,
    "test_clip_default_int8_max": NOT_FLOAT32, "test_clip_default_int8_min": NOT_FLOAT32,
    "test_maxpool_2d_uint8": NOT_FLOAT32,
    "test_identity_opt": NOT_A_TENSOR, "test_identity_sequence": NOT_A_TENSOR,
    "test_flatten_axis0": FLATTEN_AXIS, "test_flatten_axis2": FLATTEN_AXIS, "test_flatten_axis3": FLATTEN_AXIS,
    "test_flatten_negative_axis1": FLATTEN_AXIS, "test_flatten_negative_axis2": FLATTEN_AXIS,
    "test_flatten_negative_axis4": FLATTEN_AXIS,
    "test_gemm_all_attributes": GEMM_TRANSPOSED_A, "test_gemm_transposeA": GEMM_TRANSPOSED_A,
    "test_gemm_default_matrix_bias": GEMM_MATRIX_BIAS,
    "test_matmul_3d": MATMUL_BATCHED, "test_matmul_4d": MATMUL_BATCHED, "test_matmul_4d_1d": MATMUL_BATCHED,
    "test_matmul_bcast": MATMUL_BATCHED,
    "test_reshape_allowzero_reordered": RESHAPE_NOT_FLATTEN, "test_reshape_extended_dims": RESHAPE_NOT_FLATTEN,
    "test_reshape_negative_dim": RESHAPE_NOT_FLATTEN, "test_reshape_negative_extended_dims": RESHAPE_NOT_FLATTEN,
    "test_reshape_one_dim": RESHAPE_NOT_FLATTEN, "test_reshape_reordered_all_dims": RESHAPE_NOT_FLATTEN,
    "test_reshape_reordered_last_dims": RESHAPE_NOT_FLATTEN,
    "test_reshape_zero_and_negative_dim": RESHAPE_NOT_FLATTEN, "test_reshape_zero_dim": RESHAPE_NOT_FLATTEN,
    "test_softmax_axis_0": SOFTMAX_AXIS, "test_softmax_axis_1": SOFTMAX_AXIS, "test_softmax_axis_2": SOFTMAX_AXIS,
    "test_softmax_default_axis": SOFTMAX_AXIS, "test_softmax_negative_axis": SOFTMAX_AXIS,
}


def _cases_from_folder(folder: Path) -> list:
    cases = []
    for case_dir in sorted(folder.glob("test_*")):
        model = onnx.load(str(case_dir / "model.onnx"))
        if len(model.graph.node) != 1 or model.graph.node[0].op_type not in CLAIMED_OPS:
            continue
        data = case_dir / "test_data_set_0"

        def read(kind):
            tensors = []
            for path in sorted(data.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.split("_")[1])):
                proto = onnx.TensorProto()
                proto.ParseFromString(path.read_bytes())
                tensors.append(numpy_helper.to_array(proto))
            return tensors
        cases.append((case_dir.name, model, read("input"), read("output")))
    return cases


def _cases_from_scripts() -> list:
    import onnx.backend.test.case.node as node_cases

    for module in CLAIMED_OPS.values():
        importlib.import_module(f"onnx.backend.test.case.node.{module}")
    cases = []
    for case in node_cases._NodeTestCases:
        if len(case.model.graph.node) == 1 and case.model.graph.node[0].op_type in CLAIMED_OPS:
            inputs, outputs = case.data_sets[0]
            cases.append((case.name, case.model, list(inputs), list(outputs)))
    return cases


def node_cases() -> list:
    folder = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    cases = _cases_from_folder(folder) if folder.is_dir() else _cases_from_scripts()
    return sorted(cases, key=lambda case: case[0])


CASES = node_cases()


def adapt(model, inputs, outputs):
    """A node test -> (lnn Model, weights, input batch, expected output).

    Every input after the first becomes an initializer holding its test value. An element-wise op on a
    rank-1 vector [K] runs as a batch of one, [1, K] (the values do not depend on the shape)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    batch, expected = inputs[0], outputs[0]
    for value_info, value in list(zip(graph.input, inputs))[1:]:
        if isinstance(value, onnx.TensorProto):
            constant = onnx.TensorProto.FromString(value.SerializeToString())
            constant.name = value_info.name
        else:
            constant = numpy_helper.from_array(np.asarray(value), value_info.name)
        graph.initializer.append(constant)
    del graph.input[1:]
    if graph.node[0].op_type in ELEMENTWISE and isinstance(batch, np.ndarray) and batch.ndim == 1:
        batch, expected = batch[None], expected[None]
        for value_info in (graph.input[0], graph.output[0]):
            value_info.CopyFrom(onnx.helper.make_tensor_value_info(
                value_info.name, value_info.type.tensor_type.elem_type, [1, len(batch[0])]))
    lnn_model, weights = import_onnx(model)
    return lnn_model, weights, batch, expected


DEVICES = runtime_devices()
RESULTS = {"ran": 0, "passed": 0, "skipped": 0}


def test_skips_name_real_cases():
    names = {case[0] for case in CASES}
    assert not set(SKIPS) - names, f"SKIPS lists cases the onnx package does not have: {sorted(set(SKIPS) - names)}"


@pytest.mark.parametrize("name, model, inputs, outputs", CASES, ids=[case[0] for case in CASES])
def test_node_vector(name, model, inputs, outputs):
    if name in SKIPS:
        RESULTS["skipped"] += 1
        with pytest.raises(LnnError):       # lnn must refuse what it cannot express, not run it wrongly
            adapt(model, inputs, outputs)
        pytest.skip(SKIPS[name])
    RESULTS["ran"] += 1
    lnn_model, weights, batch, expected = adapt(model, inputs, outputs)
    for device in DEVICES:
        got = backend_class(device)(lnn_model, weights).run(np.ascontiguousarray(batch, dtype=np.float32))
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=f"{name} on {device}")
    RESULTS["passed"] += 1


def test_summary():
    """Runs last in this file: one line with the counts (pytest -s shows it)."""
    print(f"\nONNX node vectors for {len(CLAIMED_OPS)} ops: {len(CASES)} cases, {RESULTS['ran']} ran, "
          f"{RESULTS['passed']} passed on {' and '.join(DEVICES)}, {RESULTS['skipped']} skipped (reasons in SKIPS)")
