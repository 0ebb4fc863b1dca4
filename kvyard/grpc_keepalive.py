"""HTTP/2 keepalive for the gRPC links between roles (frontend → backend, prefill → decode, master → backend).

A peer that drops off the network (a pulled cable, a partition, a node gone) sends no reset: without pings a
stream to it waits for TCP's retransmission timeout (~15 min), so a client's stream would hang instead of
ending with an error. With these, either end notices within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS: the
client's call fails UNAVAILABLE (the frontend sends its error chunk), and the backend cancels the RPC, which
aborts the request and frees its KV. tests/multihost/ cuts links to check it.
"""
from __future__ import annotations

KEEPALIVE_TIME_MS = 5000      # a ping after this long without one
KEEPALIVE_TIMEOUT_MS = 5000   # no answer within it: the connection is dead

CLIENT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),  # an idle channel to a vanished peer is noticed too
    ("grpc.http2.max_pings_without_data", 0),    # keep pinging while the peer sends nothing (that is the point)
]

# The server accepts the clients' pings at that rate (gRPC's default calls a ping more often than every
# 5 min a strike and closes the connection after two) and pings its clients the same way.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
