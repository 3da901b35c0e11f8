"""The gRPC surface of the allocator: the servicer (unpack, call the
service, pack), the interceptors (roles, per-RPC latency), the Prometheus
collector and the server's assembly (`server.py`: create_server, serve).
Nothing below this room imports it.
"""
