"""The Tinker SDK's protobuf bodies, read and written with the SDK's own message classes (`tinker.proto`): a
`forward_backward` request's data, its output, and a sample's response. Tensors travel as little-endian bytes with a
dtype and shape (dense) or in CSR form (sparse weights); token chunks as int32 bytes."""

import numpy as np
import torch

from lorarl.trainer.serve.losses import LOSSES
from lorarl.trainer.serve.sampling import Sequence
from lorarl.trainer.serve.tenancy import Datum, RequestError

PROTOBUF = "application/x-protobuf"


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _numpy_dtype(dtype: int):
    pb = _pb()
    table = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if dtype not in table:
        raise RequestError(f"tensor dtype {pb.DType.Name(dtype)}: expected float32, int64 or int32")
    return table[dtype]


def tensor(message, key: str) -> np.ndarray:
    """A `Tensor` message as an array (`key` names it in errors)."""
    dtype = _numpy_dtype(message.dtype)
    shape = list(message.shape)
    if message.WhichOneof("encoding") == "sparse_csr":
        csr = message.sparse_csr
        values = np.frombuffer(csr.values, dtype)
        rows, cols = np.frombuffer(csr.crow_indices, np.int64), np.frombuffer(csr.col_indices, np.int64)
        if len(shape) != 2 or len(rows) != shape[0] + 1 or len(cols) != len(values):
            raise RequestError(f"{key}: a sparse tensor's indices do not fit its shape {shape}")
        out = np.zeros(shape, dtype)
        for row in range(shape[0]):
            out[row, cols[rows[row] : rows[row + 1]]] = values[rows[row] : rows[row + 1]]
        return out
    data = message.dense
    if len(data) % np.dtype(dtype).itemsize:
        raise RequestError(f"{key}: {len(data)} bytes is not a whole number of {np.dtype(dtype).name} values")
    values = np.frombuffer(data, dtype)
    if shape and int(np.prod(shape)) != values.size:
        raise RequestError(f"{key}: {values.size} values do not fill the shape {shape}")
    return values.reshape(shape) if shape else values


def tokens_of(chunks, key: str) -> list[int]:
    """The token ids of a model input's chunks (text chunks only)."""
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise RequestError(f"{key}[{i}]: a {kind} chunk; this server takes encoded_text chunks only")
        ids.extend(np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist())
    return ids


def parse_forward_backward(body: bytes):
    """A `ForwardBackwardRequest` message (its `model_id` and `seq_id` order it; `read_data` checks the rest)."""
    message = _pb().ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:
        raise RequestError(f"forward_backward: the body is not a ForwardBackwardRequest ({error})") from None
    if not message.model_id:
        raise RequestError("forward_backward: expected the field 'model_id'")
    return message


def read_data(message) -> tuple[list[Datum], str, dict[str, float]]:
    """`(data, loss_fn, loss_fn_config)` of a `ForwardBackwardRequest`, every field checked and named when wrong."""
    if message.loss_fn not in LOSSES:
        raise RequestError(f"loss_fn={message.loss_fn!r}: expected one of {', '.join(LOSSES)}")
    _, needed, defaults = LOSSES[message.loss_fn]
    config = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise RequestError(f"loss_fn_config.{key}: expected a number")
        config[key] = value.number
    unknown = set(config) - set(defaults)
    if unknown:
        raise RequestError(f"loss_fn_config: {', '.join(sorted(unknown))} not taken by {message.loss_fn} "
                           f"(it takes: {', '.join(defaults) or 'nothing'})")  # fmt: skip
    if not message.data:
        raise RequestError("data: expected at least one datum")
    data = []
    for i, datum in enumerate(message.data):
        where = f"data[{i}]"
        tokens = tokens_of(datum.model_input, f"{where}.model_input")
        if not tokens:
            raise RequestError(f"{where}.model_input: empty (a datum needs at least one input token)")
        inputs = datum.loss_fn_inputs
        if "target_tokens" not in inputs:
            raise RequestError(f"{where}.loss_fn_inputs: expected target_tokens")
        targets = tensor(inputs["target_tokens"], f"{where}.loss_fn_inputs.target_tokens")
        if targets.ndim not in (1, 2) or len(targets) != len(tokens):
            raise RequestError(f"{where}.loss_fn_inputs.target_tokens: expected [N] or [N, K] targets for the N = "
                               f"{len(tokens)} input tokens, got shape {list(targets.shape)}")  # fmt: skip
        floats = {}
        for name in needed:
            if name not in inputs and name == "weights":
                floats[name] = torch.ones(targets.shape)
                continue
            if name not in inputs:
                raise RequestError(f"{where}.loss_fn_inputs: {message.loss_fn} needs {name}")
            values = tensor(inputs[name], f"{where}.loss_fn_inputs.{name}")
            if values.shape != targets.shape:
                raise RequestError(f"{where}.loss_fn_inputs.{name}: shape {list(values.shape)}, expected "
                                   f"{list(targets.shape)} (that of target_tokens)")  # fmt: skip
            floats[name] = torch.from_numpy(values.astype(np.float32))
        data.append(Datum(tokens, torch.from_numpy(targets.astype(np.int64)), floats))
    return data, message.loss_fn, config


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], loss: float) -> bytes:
    """A `ForwardBackwardOutput`: one record per datum (its `logprobs` and `elementwise_loss`), `loss:sum`."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics["loss:sum"] = loss
    for datum in outputs:
        record = out.loss_fn_outputs.add()
        record.num_datums = 1
        for name, values in datum.items():
            array = values.numpy().astype(np.float32)
            record.fields[name].CopyFrom(pb.BatchedTensor(data=array.tobytes(), dtype=pb.DTYPE_FLOAT32,
                                                          offsets=np.array([0, array.nbytes], np.int64).tobytes(),
                                                          trailing_shape=list(array.shape[1:])))  # fmt: skip
    return out.SerializeToString()


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    pb = _pb()
    response = pb.SampleResponse()
    for sequence in sequences:
        response.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        response.prompt_logprobs = np.asarray(values, np.float32).tobytes()
    return response.SerializeToString()
