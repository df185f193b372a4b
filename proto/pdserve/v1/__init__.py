"""pdserve.v1: `from proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc`."""
