// Keepalive pings on the gRPC connections between the client tools (sdm-client, sdm-bench serve:
// client/connection.h) and sdm-server (server/server.cc). Both ends' settings live here, side by
// side, so that the server accepts every ping the clients send (tests/client/keepalive_test.cc
// checks the pair against gRPC's rules).
//
// Why: a call on a connection that died silently (a NAT or load balancer that dropped an idle
// flow, a server host that vanished: no FIN, no RST) is otherwise noticed only by TCP's
// retransmission timeout, minutes later, and only once something is written: a stream waiting
// for its first token or a chat between turns writes nothing. The client pings after
// kKeepaliveTimeMs without reading anything and closes the connection when no answer comes
// within kKeepaliveTimeoutMs (its calls fail with UNAVAILABLE; the next call reconnects). The
// pings also keep such middleboxes from dropping the flow as idle. A proxy in between
// (deploy/nginx/nginx.conf) answers them itself.
//
// gRPC's server polices pings: while it sends nothing, a ping sooner than its minimum interval
// after the previous one (by default 5 minutes, and 2 hours on a connection without calls) is a
// strike, and past GRPC_ARG_HTTP2_MAX_PING_STRIKES strikes it closes the connection with GOAWAY
// "too_many_pings". Its minimum here is a third of the client's interval, with or without calls,
// so a client with these settings is never struck; one pinging faster still is.
//
// Header-only constants: thread-safe.
#ifndef SDMSERVE_COMMON_GRPC_KEEPALIVE_H_
#define SDMSERVE_COMMON_GRPC_KEEPALIVE_H_

#include "grpc/grpc.h"

namespace sdm {

// One integer gRPC channel argument.
struct GrpcIntArg {
  const char* name;
  int value;
};

// The client pings after this long without reading anything...
inline constexpr int kKeepaliveTimeMs = 30'000;
// ...and closes the connection when the answer takes longer than this. More than gRPC's backup
// poll interval (5 s): between calls nothing else reads the connection, so the answer is seen
// only at the next backup poll (5 s after the ping, as observed with gRPC 1.51).
inline constexpr int kKeepaliveTimeoutMs = 10'000;
// The server takes pings this far apart without a strike (gRPC's default: 5 minutes).
inline constexpr int kServerMinPingIntervalMs = 10'000;
// Strikes before GOAWAY (gRPC's default, stated so that abuse protection stays visible).
inline constexpr int kServerMaxPingStrikes = 2;
// The server pings a connection after this long without reading anything, and closes it when
// the answer takes longer than kServerKeepaliveTimeoutMs (gRPC's defaults: 2 hours, 20 s). So a
// client that vanished (its host or network gone: no FIN, no RST) has its calls cancelled within
// about 40 s: its job leaves the batch and its session's lease is free for the client's retry
// (otherwise "already generating" until the job ran to max_tokens). Clients answer pings
// without policing them (gRPC polices only the pings a server receives).
inline constexpr int kServerKeepaliveTimeMs = 30'000;
inline constexpr int kServerKeepaliveTimeoutMs = 10'000;

// What the client tools set on their channels.
inline constexpr GrpcIntArg kClientKeepaliveArgs[] = {
    {GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs},
    {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs},
    // Between calls too (a chat waiting for its next turn): the next call finds the connection
    // alive, or a new one, instead of hanging on a dead one.
    {GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1},
    // gRPC (before L116) sends at most 2 pings until the client writes data again, which a
    // streaming call does not do after its request: 0 lifts the limit.
    {GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0},
};

// What sdm-server sets on its gRPC port.
inline constexpr GrpcIntArg kServerKeepaliveArgs[] = {
    {GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kServerMinPingIntervalMs},
    // Pings on a connection without calls (the clients' between calls) are held to the same
    // interval, not to 2 hours.
    {GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1},
    {GRPC_ARG_HTTP2_MAX_PING_STRIKES, kServerMaxPingStrikes},
    // Its own pings (ServerOptions::grpc_keepalive_time and _timeout set the interval) go on
    // while a stream waits for its first token or a connection is idle: without this, gRPC
    // sends at most 2 pings until the server writes data again.
    {GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0},
};

}  // namespace sdm

#endif  // SDMSERVE_COMMON_GRPC_KEEPALIVE_H_
