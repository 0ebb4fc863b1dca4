"""Generated gRPC/protobuf modules for the backend service (see model_rpc.proto; `make proto`)."""
