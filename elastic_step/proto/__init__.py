"""Wire protocol: the generated gRPC modules and tensor (de)serialisation.

`elastic_pb2*.py` are generated from `elastic.proto` by `python -m elastic_step.proto.generate`;
a test fails when they are stale.
"""
