// One non-interactive Codex CLI turn (`codex exec`) against a Responses API server.
//
// Usage: node codex_exec.mjs --base-url http://127.0.0.1:8000/v1 --model NAME
//            [--api-key KEY] [--prompt TEXT] [--workdir DIR] [--context-window TOKENS] [--timeout-s S]
//            [--websockets]
//
// Codex runs as shipped: a custom provider (`wire_api = "responses"`) in the config.toml of a
// fresh CODEX_HOME, no sandbox and no approvals (the commands the model calls really run, in
// --workdir), nothing persisted (--ephemeral). What could reach the internet is off: the update
// check, analytics, feedback; and HTTP(S)_PROXY points at a closed port, so anything else that
// tries fails at once instead of waiting (the server on 127.0.0.1 is exempt through NO_PROXY).
//
// Prints one JSON object on stdout: Codex's exit code, its JSONL events, the commands it ran
// (command, exit code, output), its agent messages and the last one, error items, stderr's
// tail. Exits 1 when Codex fails, reports a failed turn or an error event, or ends without an
// answer; 2 on bad usage.

import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const { values: args } = parseArgs({
  options: {
    "base-url": { type: "string" },
    model: { type: "string" },
    "api-key": { type: "string", default: process.env.RESQ_TEST_API_KEY ?? "sk-unused" },
    prompt: { type: "string", default: "Run the command `echo resq-codex-ok`." },
    workdir: { type: "string" },
    "context-window": { type: "string" },
    "timeout-s": { type: "string", default: "300" },
    websockets: { type: "boolean", default: false },
  },
});
if (!args["base-url"] || !args.model) {
  console.error("usage: node codex_exec.mjs --base-url URL --model NAME [--api-key KEY] [--prompt TEXT] [--workdir DIR]");
  process.exit(2);
}

const toml = (value) => JSON.stringify(value); // a TOML basic string is a JSON string
const config = [
  `model_provider = "local"`,
  `model = ${toml(args.model)}`,
  ...(args["context-window"] ? [`model_context_window = ${Number(args["context-window"])}`] : []),
  `check_for_update_on_startup = false`,
  ``,
  `[model_providers.local]`,
  `name = "resq"`,
  `base_url = ${toml(args["base-url"])}`,
  `wire_api = "responses"`,
  `env_key = "RESQ_CODEX_API_KEY"`,
  // --websockets: Codex's WebSocket transport (GET /v1/responses upgraded) instead of HTTP SSE.
  ...(args.websockets ? [`supports_websockets = true`] : []),
  // A failure shows at once, not after five retries with backoff.
  `request_max_retries = 0`,
  `stream_max_retries = 0`,
  ``,
  `[analytics]`,
  `enabled = false`,
  ``,
  `[feedback]`,
  `enabled = false`,
  ``,
  `[history]`,
  `persistence = "none"`,
  ``,
  // Curated plugin sync (git ls-remote github.com/openai/plugins, api.github.com, chatgpt.com),
  // ChatGPT apps and in-app updates are network features; off, the request is otherwise the same.
  `[features]`,
  `plugins = false`,
  `remote_plugin = false`,
  `apps = false`,
  `in_app_updates = false`,
  ``,
].join("\n");

const codexHome = mkdtempSync(join(tmpdir(), "resq-codex-home-"));
const workdir = args.workdir ?? mkdtempSync(join(tmpdir(), "resq-codex-work-"));
writeFileSync(join(codexHome, "config.toml"), config);

const codex = fileURLToPath(new URL("./node_modules/@openai/codex/bin/codex.js", import.meta.url));
const closedPort = "http://127.0.0.1:9";
const env = {
  ...process.env,
  CODEX_HOME: codexHome,
  RESQ_CODEX_API_KEY: args["api-key"],
  HTTP_PROXY: closedPort,
  HTTPS_PROXY: closedPort,
  ALL_PROXY: closedPort,
  http_proxy: closedPort,
  https_proxy: closedPort,
  all_proxy: closedPort,
  NO_PROXY: "127.0.0.1,localhost",
  no_proxy: "127.0.0.1,localhost",
  RUST_LOG: process.env.RUST_LOG ?? "warn",
};
const argv = [
  codex, "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
  "--ephemeral", "--color", "never", "-C", workdir, args.prompt,
];

const child = spawn(process.execPath, argv, { env, cwd: workdir, stdio: ["ignore", "pipe", "pipe"] });
let stdout = "";
let stderr = "";
child.stdout.on("data", (chunk) => { stdout += chunk; });
child.stderr.on("data", (chunk) => { stderr += chunk; });
const timer = setTimeout(() => {
  stderr += `\n[codex_exec.mjs] timed out after ${args["timeout-s"]}s; killing codex\n`;
  child.kill("SIGKILL");
}, Number(args["timeout-s"]) * 1000);
const exitCode = await new Promise((resolve) => child.on("close", (code, signal) => resolve(code ?? signal)));
clearTimeout(timer);
rmSync(codexHome, { recursive: true, force: true });

const events = [];
for (const line of stdout.split("\n")) {
  if (!line.trim()) continue;
  try {
    events.push(JSON.parse(line));
  } catch {
    events.push({ type: "unparsed", line });
  }
}
const completed = events.filter((e) => e.type === "item.completed").map((e) => e.item);
const commands = completed
  .filter((item) => item.type === "command_execution")
  .map(({ command, exit_code, aggregated_output, status }) => ({ command, exit_code, aggregated_output, status }));
const agentMessages = completed.filter((item) => item.type === "agent_message").map((item) => item.text);
const errorItems = completed.filter((item) => item.type === "error").map((item) => item.message);
const failures = events.filter((e) => e.type === "turn.failed" || e.type === "error");
const result = {
  exitCode,
  workdir,
  finalMessage: agentMessages.at(-1) ?? null,
  agentMessages,
  commands,
  errorItems,
  failures,
  events,
  stderrTail: stderr.slice(-4000),
};
console.log(JSON.stringify(result));
process.exit(exitCode === 0 && failures.length === 0 && result.finalMessage !== null ? 0 : 1);
