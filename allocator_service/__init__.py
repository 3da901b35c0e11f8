"""The PagedKV allocator.

`allocator_service.core` is the block logic as a pure library (no grpc, redis,
prometheus or torch import). The gRPC server, the Redis journal and the client
library sit beside it and import it; nothing here imports them.
"""
