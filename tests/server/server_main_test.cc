// The sdm-server binary: --help, exit statuses, start-up from a flag file, graceful SIGTERM.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "sdm/v1/sdm.grpc.pb.h"
#include "server/server.h"
#include "tests/base/eventually.h"
#include "tests/server/server_test_util.h"

extern char** environ;

namespace sdm::testing {
namespace {

const std::string kServer = SDM_BINARY_DIR "/server/sdm-server";

struct ProcessRun {
  int status = -1;  // exit status, or -1
  std::string out, err;
};

// Runs the server with `args` to completion (for runs that end by themselves).
ProcessRun RunServer(const std::string& args) {
  ProcessRun r;
  // Its own file: ctest runs this binary's tests in parallel processes, sharing TempDir().
  static int runs = 0;
  const std::string err_file =
      absl::StrCat(::testing::TempDir(), "/stderr-", ::getpid(), "-", ++runs, ".txt");
  const std::string command = absl::StrCat("'", kServer, "' ", args, " 2>'", err_file, "'");
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) r.out.append(buffer, n);
  const int raw = ::pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.err = ReadFile(err_file);
  std::filesystem::remove(err_file);
  return r;
}

class ServerMainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kServer)) GTEST_SKIP() << kServer << " is not built";
  }
  ScopedTempDir dir_;
};

TEST_F(ServerMainTest, HelpDocumentsEveryFlag) {
  const ProcessRun r = RunServer("--help");
  EXPECT_EQ(r.status, 0);
  for (const char* flag : {"model",
                           "model_name",
                           "host",
                           "port",
                           "metrics_host",
                           "metrics_port",
                           "state_dir",
                           "resident_budget",
                           "host_budget",
                           "session_ttl",
                           "max_running",
                           "max_waiting",
                           "prefill_token_budget",
                           "prefill_chunk",
                           "max_prompt_tokens",
                           "max_tokens_limit",
                           "max_session_tokens",
                           "threads",
                           "api_keys",
                           "tenant_limits",
                           "tls_cert",
                           "tls_key",
                           "shutdown_grace",
                           "persist_stall_timeout",
                           "persist",
                           "persist_writers",
                           "persist_sync",
                           "persist_sync_interval",
                           "persist_io",
                           "persist_compact_ratio"}) {
    EXPECT_THAT(r.out, ::testing::HasSubstr(absl::StrCat("--", flag, " (default: "))) << flag;
  }
  EXPECT_THAT(r.out, ::testing::HasSubstr("--flagfile"));
}

// The start-up lines name addresses with HostPort: an IPv6 host in brackets (the HTTP API's line
// printed "http://:::8080/v1" for --http_host=::).
TEST(HostPortTest, BracketsAnIpv6Host) {
  EXPECT_EQ(HostPort("0.0.0.0", 80), "0.0.0.0:80");
  EXPECT_EQ(HostPort("localhost", 2), "localhost:2");
  EXPECT_EQ(HostPort("::", 8080), "[::]:8080");
  EXPECT_EQ(HostPort("::1", 1), "[::1]:1");
  EXPECT_EQ(HostPort("[::1]", 1), "[::1]:1");
}

TEST_F(ServerMainTest, UsageErrorsAndModelsThatDoNotLoad) {
  EXPECT_EQ(RunServer("").status, 2);  // no --model
  EXPECT_EQ(RunServer("--model x --resident_budget 12parsecs").status, 2);
  EXPECT_EQ(RunServer("--model x --persist_writers 0").status, 2);
  // Values ServerOptions refuses are usage errors too (they were start failures, exit 1).
  // Each message names the flag and the value given.
  for (const auto& [flag, says] : std::vector<std::pair<std::string, std::string>>{
           {"--max_running 0", "--max_running must be >= 1, got 0"},
           {"--max_waiting -1", "--max_waiting must be >= 0, got -1"},
           {"--prefill_token_budget 0", "--prefill_token_budget must be >= 1, got 0"},
           {"--port 70000", "--port must be in [0, 65535], got 70000"},
           {"--session_ttl 1000000h", "ttl"},
           {"--decode_nice 25", "--decode_nice"},
           {"--max_session_tokens -2", "--max_session_tokens must be >= 0"},
           {"--device cuda --cpu_dtype bf16", "--cpu_dtype applies to the CPU engine only"},
           {"--http_max_connections 0", "--http_max_connections must be >= 1, got 0"},
           {"--shutdown_grace -1s", "--shutdown_grace must not be negative, got -1s"},
           {"--tls_cert /x.pem", "TLS needs both --tls_cert and --tls_key"}}) {
    const ProcessRun r = RunServer(absl::StrCat("--model x ", flag));
    EXPECT_EQ(r.status, 2) << flag << ": " << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr(says)) << flag;
  }
  // The HTTP API's options without the HTTP API would fail only the day it is turned on.
  for (const char* flag : {"--chat_template /nonexistent.json", "--http_cors_origins notaurl"}) {
    const ProcessRun r = RunServer(absl::StrCat("--model x ", flag));
    EXPECT_EQ(r.status, 2) << flag << ": " << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr("need --http_port (the HTTP API is off)")) << flag;
  }
  // Replicas: sessions never expire on a shared directory (another replica may serve them).
  const ProcessRun ttl = RunServer(absl::StrCat("--model x --state_dir '", dir_.path().string(),
                                                "' --shared_state_dir --session_ttl 30m"));
  EXPECT_EQ(ttl.status, 2);
  EXPECT_THAT(ttl.err,
              ::testing::HasSubstr("--session_ttl cannot be used with --shared_state_dir"));
  // An etcd key prefix must be a path ("/name/"): checked before etcd is reached.
  const ProcessRun prefix =
      RunServer(absl::StrCat("--model x --state_dir '", dir_.path().string(),
                             "' --shared_state_dir --etcd http://127.0.0.1:1 --etcd_prefix blue"));
  EXPECT_EQ(prefix.status, 2);
  EXPECT_THAT(prefix.err, ::testing::HasSubstr("--etcd_prefix: the etcd key prefix must start"));
  // --etcd is a comma-separated list of client URLs; etcd's password never comes from a flag.
  const std::string shared =
      absl::StrCat("--model x --state_dir '", dir_.path().string(), "' --shared_state_dir ");
  for (const auto& [flags, says] :
       {std::pair{"--etcd 'http://127.0.0.1:1,,http://127.0.0.1:2'", "--etcd: an empty entry"},
        std::pair{"--etcd 'http://127.0.0.1:1,127.0.0.1:2'", "'127.0.0.1:2': no scheme"},
        std::pair{"--etcd http://127.0.0.1:1 --etcd_user root",
                  "--etcd_user needs --etcd_password_file or SDM_ETCD_PASSWORD"},
        std::pair{"--etcd http://127.0.0.1:1 --etcd_ca_file /etc/hostname",
                  "no etcd endpoint is https://"},
        std::pair{"--etcd_user root --etcd_password_file /etc/hostname", "need --etcd"},
        // etcd grants whole seconds: 2500ms was granted as 2 s.
        std::pair{"--etcd http://127.0.0.1:1 --etcd_lease_ttl 2500ms",
                  "--etcd_lease_ttl: the etcd lease TTL must be whole seconds, at least 2s"},
        std::pair{"--etcd http://127.0.0.1:1 --etcd_lease_ttl 1s", "at least 2s, got 1s"},
        std::pair{"--etcd http://127.0.0.1:1 --etcd_request_timeout 0s",
                  "--etcd_request_timeout: must be positive and finite, got 0"},
        std::pair{"--etcd http://127.0.0.1:1 --etcd_request_timeout inf", "finite, got inf"}}) {
    const ProcessRun r = RunServer(shared + flags);
    EXPECT_EQ(r.status, 2) << flags << ": " << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr(says)) << flags;
  }
  // What absl's parser refuses is a usage error too (absl alone exits 1), naming the flag.
  for (const auto& [flags, says] :
       {std::pair{"--etcd_password secret", "unknown flag --etcd_password"},
        std::pair{"--nosuchflag=1", "unknown flag --nosuchflag"},
        std::pair{"--session_ttl=abc", "'abc' specified for flag 'session_ttl'"},
        std::pair{"--max_running many", "'many' specified for flag 'max_running'"},
        std::pair{"--shared_state_dir=maybe", "'maybe' specified for flag 'shared_state_dir'"},
        std::pair{"--noshared_state_dir=1", "--noshared_state_dir takes no value"},
        std::pair{"--port", "--port needs a value"}}) {
    const ProcessRun r = RunServer(absl::StrCat("--model x ", flags));
    EXPECT_EQ(r.status, 2) << flags << ": " << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr(says)) << flags;
  }
  // The same in a --flagfile (absl exits 1 there too, naming no file), and what absl refuses in
  // the file itself: the message names the file and the line.
  const std::string file = (dir_.path() / "bad.flags").string();
  const std::string inner = (dir_.path() / "inner.flags").string();
  const std::string absent = (dir_.path() / "absent.flags").string();
  WriteFile(inner, "# included\n--threads=1\n--nosuchflag=2\n");
  for (const auto& [content, says] :
       {std::pair<std::string, std::string>{"--threads=1\n--nosuchflag=1\n",
                                            "unknown flag --nosuchflag (line 2 of --flagfile="},
        {"# comment\n\n  --session_ttl=abc\n",
         "'abc' specified for flag 'session_ttl' (line 3 of --flagfile="},
        {"--max_running\n--port=0\n",
         "'--port=0' specified for flag 'max_running' (line 1 of --flagfile="},
        {"--port\n", "--port needs a value (line 1 of --flagfile="},
        {"--noshared_state_dir=1\n", "--noshared_state_dir takes no value (line 1 of"},
        {"--threads=1\nport=0\n", "not a flag: 'port=0' (line 2 of --flagfile="},
        {"--\n", "not a flag: '--' (line 1 of --flagfile="},
        {absl::StrCat("--flagfile=", inner, "\n"),
         absl::StrCat("unknown flag --nosuchflag (line 3 of --flagfile=", inner, ")")},
        {absl::StrCat("--flagfile=", absent, "\n"),
         absl::StrCat("cannot read the flag file '", absent, "'")}}) {
    WriteFile(file, content);
    const ProcessRun r = RunServer(absl::StrCat("--model x --flagfile='", file, "'"));
    EXPECT_EQ(r.status, 2) << content << ": " << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr(says)) << content;
    if (!absl::StrContains(content, "--flagfile=")) {
      EXPECT_THAT(r.err, ::testing::HasSubstr(absl::StrCat("--flagfile=", file, ")"))) << content;
    }
  }
  const ProcessRun no_file = RunServer(absl::StrCat("--model x --flagfile '", absent, "'"));
  EXPECT_EQ(no_file.status, 2) << no_file.err;
  EXPECT_THAT(no_file.err,
              ::testing::HasSubstr(absl::StrCat("cannot read the flag file '", absent,
                                                "' (--flagfile): No such file or directory")));
  // Without --etcd the lease TTL is not used, and not checked.
  EXPECT_THAT(RunServer("--model x --etcd_lease_ttl 1s").err,
              ::testing::Not(::testing::HasSubstr("--etcd_lease_ttl")));
  EXPECT_EQ(RunServer("--model x --persist_sync sometimes").status, 2);
  const ProcessRun io = RunServer("--model x --persist_io mmap");
  EXPECT_EQ(io.status, 2);
  EXPECT_THAT(io.err, ::testing::HasSubstr("--persist_io"));
  EXPECT_EQ(RunServer("--model x --persist_compact_ratio -1").status, 2);
  const ProcessRun arenas = RunServer("--model x --malloc_arena_max -1");
  EXPECT_EQ(arenas.status, 2);
  EXPECT_THAT(arenas.err, ::testing::HasSubstr("--malloc_arena_max"));
  const ProcessRun tcache = RunServer("--model x --malloc_tcache_count -2");
  EXPECT_EQ(tcache.status, 2);
  EXPECT_THAT(tcache.err, ::testing::HasSubstr("--malloc_tcache_count"));
  const ProcessRun missing =
      RunServer(absl::StrCat("--model '", (dir_.path() / "absent").string(), "' --port 0"));
  EXPECT_EQ(missing.status, 1);
  EXPECT_THAT(missing.err, ::testing::HasSubstr("cannot load the model"));
  EXPECT_THAT(missing.err, ::testing::HasSubstr("absent"));
}

// Reads one line from `fd` within `timeout`; empty on timeout or end of file.
std::string ReadLine(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < give_up) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char c;
    if (::read(fd, &c, 1) != 1) break;
    if (c == '\n') return line;
    line += c;
  }
  return "";
}

// A started sdm-server: its pid and the read end of its standard output (pid -1: the spawn
// failed).
struct SpawnedServer {
  pid_t pid = -1;
  int out = -1;
};

// Starts kServer with `args` (after the program name), its standard output a pipe and its
// standard error written to `err` (empty: inherited).
SpawnedServer SpawnServer(std::vector<std::string> args, const std::filesystem::path& err = {}) {
  int out[2];
  if (::pipe(out) != 0) return {};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  if (!err.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  args.insert(args.begin(), kServer);
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, kServer.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  if (spawned != 0) {
    ::close(out[0]);
    return {};
  }
  return {pid, out[0]};
}

// Without --api_keys every caller is the tenant "default": listening off loopback, the server
// says so at start-up (before the model loads: "x" here does not), as it does of a key file every
// user can read. On loopback, or with a private key file, it says nothing of either.
TEST_F(ServerMainTest, OpenAccessIsSaidAtStartUp) {
  const std::string no_state = "--model x --state_dir= --metrics_port -1 ";
  const ProcessRun open = RunServer(no_state + "--host 0.0.0.0 --port 0 --http_port -1");
  EXPECT_EQ(open.status, 1) << open.err;  // the model
  EXPECT_THAT(open.err, ::testing::HasSubstr("no --api_keys: every caller on 0.0.0.0:0 is the "
                                             "tenant 'default'"));
  const ProcessRun http = RunServer(no_state + "--http_host 0.0.0.0 --http_port 0");
  EXPECT_THAT(http.err, ::testing::HasSubstr("no --api_keys: every caller on 0.0.0.0:0"));
  const ProcessRun loopback = RunServer(no_state + "--host 127.0.0.1 --http_host 127.0.0.1");
  EXPECT_EQ(loopback.status, 1) << loopback.err;
  EXPECT_THAT(loopback.err, ::testing::Not(::testing::HasSubstr("--api_keys")));

  const std::filesystem::path keys = dir_.path() / "api_keys";
  { std::ofstream(keys) << "sk-0123456789abcdef alice\n"; }
  std::filesystem::permissions(
      keys, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const std::string with_keys =
      absl::StrCat(no_state, "--host 0.0.0.0 --port 0 --api_keys '", keys.string(), "'");
  const ProcessRun private_keys = RunServer(with_keys);
  EXPECT_EQ(private_keys.status, 1) << private_keys.err;
  EXPECT_THAT(private_keys.err, ::testing::HasSubstr("model"));  // the keys were read
  EXPECT_THAT(private_keys.err, ::testing::Not(::testing::HasSubstr("every caller")));
  EXPECT_THAT(private_keys.err, ::testing::Not(::testing::HasSubstr("can be read by every user")));
  std::filesystem::permissions(keys, std::filesystem::perms::others_read,
                               std::filesystem::perm_options::add);
  const ProcessRun readable = RunServer(with_keys);
  EXPECT_THAT(readable.err, ::testing::HasSubstr("can be read by every user of this host (mode "
                                                 "0604): chmod o-rwx it"));
}

// A tenant limits entry that names no key's tenant limits nobody (a typo leaves the tenant meant
// with the default's limits): said at start-up, before the model loads. Without keys the one
// tenant is "default".
TEST_F(ServerMainTest, LimitsForTenantsNoKeyMapsToAreSaidAtStartUp) {
  const std::filesystem::path keys = dir_.path() / "api_keys", limits = dir_.path() / "limits";
  { std::ofstream(keys) << "sk-0123456789abcdef alice\nsk-abcdef0123456789 bob\n"; }
  std::filesystem::permissions(
      keys, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  { std::ofstream(limits) << R"({"tenants": {"alice": {}, "bobb": {}, "default": {}}})"; }
  const std::string no_model = absl::StrCat("--model x --state_dir= --metrics_port -1 --port 0 ",
                                            "--tenant_limits '", limits.string(), "'");
  const ProcessRun with_keys =
      RunServer(absl::StrCat(no_model, " --api_keys '", keys.string(), "'"));
  EXPECT_EQ(with_keys.status, 1) << with_keys.err;  // the model
  EXPECT_THAT(with_keys.err,
              ::testing::HasSubstr("the tenant limits name tenants no API key maps to (bobb, "
                                   "default; the keys' tenants: alice, bob)"));
  const ProcessRun without_keys = RunServer(no_model);
  EXPECT_THAT(without_keys.err, ::testing::HasSubstr("no API key maps to (alice, bobb; the keys' "
                                                     "tenants: default)"));
  { std::ofstream(limits) << R"({"tenants": {"alice": {}, "bob": {"max_requests": 2}}})"; }
  const ProcessRun known = RunServer(absl::StrCat(no_model, " --api_keys '", keys.string(), "'"));
  EXPECT_THAT(known.err, ::testing::HasSubstr("model"));  // the files were read
  EXPECT_THAT(known.err, ::testing::Not(::testing::HasSubstr("no API key maps to")));
}

TEST_F(ServerMainTest, ServesFromAFlagFileAndShutsDownOnSigterm) {
  const std::filesystem::path state = dir_.path() / "state";
  const std::filesystem::path flags = dir_.path() / "server.flags";
  WriteFile(flags, absl::StrCat("# test configuration\n--model=", TinyModelDir().string(),
                                "\n--port=0\n--metrics_port=-1\n--threads=1\n--state_dir=",
                                state.string(), "\n--shutdown_grace=1s\n"));
  const SpawnedServer server = SpawnServer({absl::StrCat("--flagfile=", flags.string())});
  ASSERT_GT(server.pid, 0);

  const std::string line = ReadLine(server.out, std::chrono::seconds(30));
  ASSERT_TRUE(line.starts_with("listening on 127.0.0.1:")) << line;
  const std::string address = line.substr(13, line.find(' ', 13) - 13);
  auto stub =
      v1::SdmService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::ModelInfo info;
  EXPECT_TRUE(stub->GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.name(), "tiny-model");
  // The server executed itself again with malloc's per-thread cache off (the default
  // --malloc_tcache_count=0): same pid, flags re-read from the flag file, serving.
  if (std::getenv("GLIBC_TUNABLES") == nullptr) {
    std::ifstream environ_file(absl::StrCat("/proc/", server.pid, "/environ"), std::ios::binary);
    const std::string server_env((std::istreambuf_iterator<char>(environ_file)),
                                 std::istreambuf_iterator<char>());
    EXPECT_THAT(server_env, ::testing::HasSubstr("GLIBC_TUNABLES=glibc.malloc.tcache_count=0"));
  }
  {
    grpc::ClientContext create_context;
    v1::CreateSessionRequest request;
    request.set_session_id("saved");
    v1::Session session;
    EXPECT_TRUE(stub->CreateSession(&create_context, request, &session).ok());
  }

  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  int raw = 0;
  ASSERT_EQ(::waitpid(server.pid, &raw, 0), server.pid);
  ::close(server.out);
  ASSERT_TRUE(WIFEXITED(raw));
  EXPECT_EQ(WEXITSTATUS(raw), 0);
  // The session was persisted at shutdown.
  bool saved = false;
  for (const auto& entry : std::filesystem::directory_iterator(state)) {
    saved = saved || entry.path().filename().string().find("saved") != std::string::npos;
  }
  EXPECT_TRUE(saved);
}

// The start-up lines name the address the ports are bound to (docs/api.md, "Running the server"):
// every interface is 0.0.0.0, not the loopback address a client on the machine connects to.
TEST_F(ServerMainTest, TheStartUpLinesNameTheBoundAddress) {
  const SpawnedServer server =
      SpawnServer({absl::StrCat("--model=", TinyModelDir().string()), "--host=0.0.0.0", "--port=0",
                   "--metrics_port=-1", "--http_host=0.0.0.0", "--http_port=0", "--threads=1",
                   "--state_dir=", "--shutdown_grace=1s"});
  ASSERT_GT(server.pid, 0);

  const std::string line = ReadLine(server.out, std::chrono::seconds(30));
  const std::string http_line = ReadLine(server.out, std::chrono::seconds(5));
  EXPECT_TRUE(line.starts_with("listening on 0.0.0.0:")) << line;
  EXPECT_TRUE(http_line.starts_with("OpenAI-compatible HTTP API on http://0.0.0.0:")) << http_line;
  // The port is the one to connect to (here on loopback).
  const size_t colon = line.find(':');
  const std::string port =
      colon == std::string::npos ? "" : line.substr(colon + 1, line.find(' ', colon) - colon - 1);
  auto stub = v1::SdmService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::ModelInfo info;
  EXPECT_TRUE(stub->GetModelInfo(&context, {}, &info).ok()) << "port " << port;

  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  int raw = 0;
  ASSERT_EQ(::waitpid(server.pid, &raw, 0), server.pid);
  ::close(server.out);
  ASSERT_TRUE(WIFEXITED(raw));
  EXPECT_EQ(WEXITSTATUS(raw), 0);
}

// A stub of the server that printed `line`, its "listening on ADDRESS ..." start-up line (null
// when the line is not that, with a test failure saying so).
std::unique_ptr<v1::SdmService::Stub> StubFromStartUpLine(const std::string& line) {
  EXPECT_TRUE(line.starts_with("listening on 127.0.0.1:")) << line;
  if (!line.starts_with("listening on ")) return nullptr;
  const std::string address = line.substr(13, line.find(' ', 13) - 13);
  return v1::SdmService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

// SIGHUP reads the key file again (SdmServer::ReloadConfig): a rotated key works from then on,
// the one it replaced does not, and stderr says what was reloaded. The server keeps serving.
TEST_F(ServerMainTest, SighupReloadsTheKeyFile) {
  const std::filesystem::path err = dir_.path() / "stderr.txt", keys = dir_.path() / "keys";
  const auto write_keys = [&](const std::string& text) {
    { std::ofstream(keys) << text; }
    std::filesystem::permissions(
        keys, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  };
  write_keys("sk-0123456789abcdef alice\n");
  const SpawnedServer server = SpawnServer(
      {absl::StrCat("--model=", NoEosModelDir().string()), "--port=0", "--metrics_port=-1",
       "--threads=1", "--state_dir=", absl::StrCat("--api_keys=", keys.string())},
      err);
  ASSERT_GT(server.pid, 0);
  auto stub = StubFromStartUpLine(ReadLine(server.out, std::chrono::seconds(30)));
  ASSERT_NE(stub, nullptr);
  const auto tokenize_as = [&](const std::string& key) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + key);
    v1::TokenizeRequest request;
    request.set_text("hi");
    v1::TokenizeResponse response;
    return stub->Tokenize(&context, request, &response).error_code();
  };
  EXPECT_EQ(tokenize_as("sk-0123456789abcdef"), grpc::StatusCode::OK);

  write_keys("sk-fedcba9876543210 alice\n");
  ASSERT_EQ(::kill(server.pid, SIGHUP), 0);
  // Waits for the server's answer on stderr (an event, however long the machine takes).
  Eventually([&] { return ReadFile(err.string()).find("SIGHUP: ") != std::string::npos; });
  EXPECT_THAT(ReadFile(err.string()),
              ::testing::HasSubstr("SIGHUP: reloaded 1 API keys of 1 tenants"));
  EXPECT_EQ(tokenize_as("sk-fedcba9876543210"), grpc::StatusCode::OK);
  EXPECT_EQ(tokenize_as("sk-0123456789abcdef"), grpc::StatusCode::UNAUTHENTICATED);

  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  int raw = 0;
  ASSERT_EQ(::waitpid(server.pid, &raw, 0), server.pid);
  ::close(server.out);
  ASSERT_TRUE(WIFEXITED(raw)) << ReadFile(err.string());
  EXPECT_EQ(WEXITSTATUS(raw), 0) << ReadFile(err.string());
}

TEST_F(ServerMainTest, ASecondSignalExitsAtOnceAndSaysItSavedNothing) {
  const std::filesystem::path err = dir_.path() / "stderr.txt";
  const SpawnedServer server = SpawnServer(
      {absl::StrCat("--model=", NoEosModelDir().string()), "--port=0", "--metrics_port=-1",
       "--threads=1", absl::StrCat("--state_dir=", (dir_.path() / "state").string()),
       "--shutdown_grace=60s", "--max_tokens_limit=1000000"},
      err);
  ASSERT_GT(server.pid, 0);
  auto stub = StubFromStartUpLine(ReadLine(server.out, std::chrono::seconds(30)));
  ASSERT_NE(stub, nullptr);
  // A stream that runs until cancelled keeps the graceful shutdown waiting (grace 60 s).
  grpc::ClientContext context;
  auto stream = stub->Generate(&context, TextRequest("endless", 1'000'000));
  v1::GenerateResponse chunk;
  ASSERT_TRUE(stream->Read(&chunk));
  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  // Wait (setup) until the server has started its graceful shutdown: the first signal was taken.
  Eventually([&] { return ReadFile(err.string()).find("shutting down") != std::string::npos; });
  ASSERT_THAT(ReadFile(err.string()), ::testing::HasSubstr("shutting down"));
  // A signal within 1 s of the first is the same request (the next test); this one comes later,
  // whatever the load: a lower bound, not a race.
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  int raw = 0;
  ASSERT_EQ(::waitpid(server.pid, &raw, 0), server.pid);
  ::close(server.out);
  ASSERT_TRUE(WIFEXITED(raw)) << "signal " << WTERMSIG(raw) << "; stderr:\n"
                              << ReadFile(err.string());
  EXPECT_EQ(WEXITSTATUS(raw), 1);
  EXPECT_THAT(ReadFile(err.string()),
              ::testing::HasSubstr("second SIGTERM: exiting now with status 1, without waiting "
                                   "for requests or saving sessions"));
  context.TryCancel();
  while (stream->Read(&chunk)) {
  }
  stream->Finish();
}

// A stop during the start (a large model takes minutes to load, etcd may be slow to answer)
// exits at once, saying so; it was held until the start was over. The start is held here in its
// first request to etcd, to a port that accepts connections and never answers: once the test
// accepted the server's connection, the server is inside the start.
TEST_F(ServerMainTest, ASignalDuringTheStartExitsAtOnce) {
  const int hole = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(hole, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(hole, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(hole, 8), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::getsockname(hole, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const std::filesystem::path err = dir_.path() / "stderr.txt";
  const SpawnedServer server = SpawnServer(
      {absl::StrCat("--model=", TinyModelDir().string()), "--port=0", "--metrics_port=-1",
       "--threads=1", absl::StrCat("--state_dir=", (dir_.path() / "state").string()),
       "--shared_state_dir", absl::StrCat("--etcd=http://127.0.0.1:", ntohs(address.sin_port)),
       "--etcd_request_timeout=10m"},
      err);
  ASSERT_GT(server.pid, 0);
  const int connection = ::accept(hole, nullptr, nullptr);  // the server is asking etcd
  ASSERT_GE(connection, 0) << ReadFile(err.string());
  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  int raw = 0;
  // Held until the start ended (10 minutes here), it would not exit: the test fails, not hangs.
  const bool exited =
      Eventually([&] { return ::waitpid(server.pid, &raw, WNOHANG) == server.pid; });
  if (!exited) {
    ::kill(server.pid, SIGKILL);
    ::waitpid(server.pid, &raw, 0);
  }
  EXPECT_TRUE(exited) << "the server did not exit on SIGTERM during its start";
  ::close(connection);
  ::close(hole);
  ::close(server.out);
  const std::string stderr_text = ReadFile(err.string());
  ASSERT_TRUE(WIFEXITED(raw)) << stderr_text;
  EXPECT_EQ(WEXITSTATUS(raw), 1);
  EXPECT_THAT(stderr_text, ::testing::HasSubstr("SIGTERM during start-up: exiting now with status "
                                                "1 (nothing was served yet)"));
}

// GNU timeout signals its child and then the child's process group; a script's EXIT trap forwards
// a SIGTERM after Ctrl-C's SIGINT reached the group: one request, two signals. Taken for a second
// request, they made the server exit at once, its unsaved sessions lost (--persist shutdown: all).
TEST_F(ServerMainTest, ASignalRepeatedAtOnceIsTheSameRequestAndTheShutdownSaves) {
  const std::filesystem::path err = dir_.path() / "stderr.txt";
  const std::string state = absl::StrCat("--state_dir=", (dir_.path() / "state").string());
  const std::vector<std::string> args = {absl::StrCat("--model=", NoEosModelDir().string()),
                                         "--port=0",
                                         "--metrics_port=-1",
                                         "--threads=1",
                                         state,
                                         "--persist=shutdown",
                                         "--shutdown_grace=0s"};
  const SpawnedServer server = SpawnServer(args, err);
  ASSERT_GT(server.pid, 0);
  auto stub = StubFromStartUpLine(ReadLine(server.out, std::chrono::seconds(30)));
  ASSERT_NE(stub, nullptr);
  ASSERT_TRUE(CreateSession(*stub, "kept").ok());
  const Completion turn = Generate(*stub, TextRequest("remember this", 3, "kept"));
  ASSERT_TRUE(turn.status.ok()) << turn.status.error_message();
  // SIGINT then SIGTERM, at once: one request to stop.
  ASSERT_EQ(::kill(server.pid, SIGINT), 0);
  ASSERT_EQ(::kill(server.pid, SIGTERM), 0);
  int raw = 0;
  ASSERT_EQ(::waitpid(server.pid, &raw, 0), server.pid);
  ::close(server.out);
  const std::string stderr_text = ReadFile(err.string());
  ASSERT_TRUE(WIFEXITED(raw)) << stderr_text;
  EXPECT_EQ(WEXITSTATUS(raw), 0) << stderr_text;
  // Which of the two the kernel delivers first is its choice.
  EXPECT_THAT(stderr_text,
              ::testing::HasSubstr("within 1 s of the first signal: taken as the same request"));
  EXPECT_THAT(stderr_text, ::testing::Not(::testing::HasSubstr("exiting now")));

  // The session was saved by the shutdown: a new server has it, with the turn.
  const SpawnedServer again = SpawnServer(args, dir_.path() / "stderr2.txt");
  ASSERT_GT(again.pid, 0);
  auto stub2 = StubFromStartUpLine(ReadLine(again.out, std::chrono::seconds(30)));
  ASSERT_NE(stub2, nullptr);
  v1::Session kept;
  EXPECT_TRUE(GetSession(*stub2, "kept", &kept).ok());
  EXPECT_EQ(kept.position(), turn.usage.prompt_tokens() + turn.usage.generated_tokens());
  ASSERT_EQ(::kill(again.pid, SIGTERM), 0);
  ASSERT_EQ(::waitpid(again.pid, &raw, 0), again.pid);
  ::close(again.out);
}

}  // namespace
}  // namespace sdm::testing
