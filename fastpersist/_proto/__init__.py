"""Generated gRPC stubs for proto/fastpersist.proto (scripts/gen_proto.py); do not edit."""
