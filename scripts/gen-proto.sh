#!/usr/bin/env bash
# Regenerate the client package's gRPC code from proto/leveret.proto (needs grpcio-tools:
# PROTOC_PYTHON names a Python that has it, default .venv/bin/python). The output is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PROTOC_PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Ileveret_client/proto=proto \
    --python_out=client --pyi_out=client --grpc_python_out=client proto/leveret.proto
