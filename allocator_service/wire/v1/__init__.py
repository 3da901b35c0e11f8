"""The generated gRPC contract, version 1 (`proto/pagedkv/v1/*.proto`, proto
package `pagedkv.v1`). It lives here, beside its only importers (the
servicer, the codec, the journal and the gRPC client).

Generated with `make proto`; do not edit the `*_pb2*.py` files by hand.
"""
