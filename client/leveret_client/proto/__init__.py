"""Code generated from proto/leveret.proto (scripts/gen-proto.sh); the broker's servicers use it too."""
