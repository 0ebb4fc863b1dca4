"""ErrorCode ⇄ ErrorCodePB, for the two gRPC edges (backend/pb_convert.py, frontend/backend_client.py)."""
from __future__ import annotations

from kvyard.errors import ErrorCode, RequestError
from proto import model_rpc_pb2 as pb

_CODE_TO_PB = {
    ErrorCode.INVALID_ARGUMENT: pb.INVALID_ARGUMENT,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: pb.CONTEXT_LENGTH_EXCEEDED,
    ErrorCode.OUT_OF_KV_CACHE: pb.OUT_OF_KV_CACHE,
    ErrorCode.OVERLOADED: pb.OVERLOADED,
    ErrorCode.TIMEOUT: pb.TIMEOUT,
    ErrorCode.CANCELLED: pb.CANCELLED,
    ErrorCode.UNAVAILABLE: pb.UNAVAILABLE,
    ErrorCode.MODEL_NOT_FOUND: pb.MODEL_NOT_FOUND,
}
_PB_TO_CODE = {v: k for k, v in _CODE_TO_PB.items()}


def error_to_pb(request_id: str, error: RequestError) -> pb.GenerateOutputsPB:
    return pb.GenerateOutputsPB(request_id=request_id, error=pb.ErrorDetailsPB(
        code=_CODE_TO_PB.get(error.code, pb.INTERNAL), message=error.message))


def error_from_pb(details: pb.ErrorDetailsPB) -> RequestError:
    return RequestError(_PB_TO_CODE.get(details.code, ErrorCode.INTERNAL), details.message)
