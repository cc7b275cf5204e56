// The web console served at `/` by the HTTP API (server/http/openai_server.h; docs/api.md, "Web
// console"): one static HTML page with its CSS and JavaScript inline, compiled into the server,
// with no external resources. It talks to the same server's /v1 endpoints: chat with streamed
// tokens, sessions (create, resume, fork, delete), sampling settings, and live figures (tokens/s,
// time to first token, session position and state bytes).
#ifndef SDMSERVE_SERVER_HTTP_CONSOLE_PAGE_H_
#define SDMSERVE_SERVER_HTTP_CONSOLE_PAGE_H_

#include "absl/strings/string_view.h"

namespace sdm {

absl::string_view ConsolePageHtml();

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_CONSOLE_PAGE_H_
