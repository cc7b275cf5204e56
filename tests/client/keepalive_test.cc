// Keepalive pings (common/grpc_keepalive.h): the client tools' channels ping, and the server's
// settings accept those pings under gRPC's rules, so that neither end can drift from the other.
// No clock: what gRPC's server would do with the client's pings follows from the two argument
// lists (doc/keepalive.md of gRPC, and chttp2's ping policy, which the comments name).
#include <climits>
#include <map>
#include <string>

#include "absl/types/span.h"
#include "client/connection.h"
#include "common/grpc_keepalive.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"

namespace sdm::client {
namespace {

// The integer arguments of `args` by name.
std::map<std::string, int> IntArgs(const grpc::ChannelArguments& args) {
  std::map<std::string, int> ints;
  const grpc_channel_args c = args.c_channel_args();
  for (size_t i = 0; i < c.num_args; ++i) {
    if (c.args[i].type == GRPC_ARG_INTEGER) ints[c.args[i].key] = c.args[i].value.integer;
  }
  return ints;
}

// `name`'s value in `args`, else gRPC's default `otherwise`.
int ArgOr(absl::Span<const GrpcIntArg> args, const std::string& name, int otherwise) {
  for (const GrpcIntArg& arg : args) {
    if (name == arg.name) return arg.value;
  }
  return otherwise;
}

TEST(KeepaliveTest, ClientChannelsPingAQuietConnection) {
  const std::map<std::string, int> args = IntArgs(ClientChannelArguments());
  EXPECT_EQ(args.at(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), 64 << 20);
  for (const GrpcIntArg& arg : kClientKeepaliveArgs) {
    ASSERT_TRUE(args.contains(arg.name)) << arg.name;
    EXPECT_EQ(args.at(arg.name), arg.value) << arg.name;
  }
  // Not merely whatever the list holds: the pings themselves.
  ASSERT_TRUE(args.contains(GRPC_ARG_KEEPALIVE_TIME_MS));
  EXPECT_EQ(args.at(GRPC_ARG_KEEPALIVE_TIME_MS), kKeepaliveTimeMs);
  EXPECT_EQ(args.at(GRPC_ARG_KEEPALIVE_TIMEOUT_MS), kKeepaliveTimeoutMs);
  EXPECT_EQ(kKeepaliveTimeMs, 30'000);
  EXPECT_EQ(kKeepaliveTimeoutMs, 10'000);
  // Between calls the answer is read at gRPC's next backup poll (every 5 s by default): a shorter
  // timeout would close healthy idle connections.
  EXPECT_GT(kKeepaliveTimeoutMs, 5'000);
}

TEST(KeepaliveTest, TheServerAcceptsEveryPingTheClientSends) {
  // gRPC's defaults (1.51) stand for what a list leaves out.
  const int client_time = ArgOr(kClientKeepaliveArgs, GRPC_ARG_KEEPALIVE_TIME_MS, INT_MAX);
  const bool client_between_calls =
      ArgOr(kClientKeepaliveArgs, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0) != 0;
  const int client_pings_without_data =
      ArgOr(kClientKeepaliveArgs, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 2);
  const int server_min_interval =
      ArgOr(kServerKeepaliveArgs, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 300'000);
  const bool server_between_calls =
      ArgOr(kServerKeepaliveArgs, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0) != 0;
  const int server_strikes = ArgOr(kServerKeepaliveArgs, GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);

  ASSERT_LT(client_time, INT_MAX) << "the client sends no keepalive pings";
  // A ping sooner than the server's minimum after the last one is a strike.
  EXPECT_LE(server_min_interval, client_time);
  // A client pinging between calls needs a server that allows it: else its minimum there is 2
  // hours and the client's idle connections are closed with too_many_pings.
  EXPECT_TRUE(client_between_calls);
  EXPECT_TRUE(server_between_calls);
  // A client reading a stream writes nothing after its request: the pings must go on anyway.
  EXPECT_EQ(client_pings_without_data, 0);
  // The server still refuses a client pinging faster than that (0 would let any through).
  EXPECT_GT(server_strikes, 0);
}

}  // namespace
}  // namespace sdm::client
