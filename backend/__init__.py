"""The backend role: PyTorch engine behind a gRPC GenerateStreamCall."""
