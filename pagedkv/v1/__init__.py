"""The generated gRPC contract, version 1 (`proto/pagedkv/v1/*.proto`).

Generated with `make proto`; do not edit the `*_pb2*.py` files by hand.
"""
