"""The native gRPC API: leveret.proto, its generated code (committed; see docs/GRPC.md) and the servicer."""
