// The Vercel AI SDK (`ai` + `@ai-sdk/openai`) as an app uses it, against a Responses API server.
//
// Usage: node vercel_chat.mjs --base-url http://127.0.0.1:8000/v1 --model fixture [--api-key KEY] [--sdk 7|6]
//
// `--sdk` picks the SDK's major: 7 (`ai` 7 + `@ai-sdk/openai` 4, the default) or 6 (`ai` 6 +
// `@ai-sdk/openai` 3, installed under the aliases `ai-v6` and `@ai-sdk/openai-v3`): apps on both
// are in use, and each major's provider builds its requests its own way.
//
// Provider settings are the SDK's defaults: `createOpenAI({baseURL, apiKey}).responses(model)`,
// so `store` is true and a later turn sends the earlier assistant output back as
// `{"type": "item_reference", "id": "msg_..."}` items. Every call sets `temperature: 0` (the
// fixture model's answers are exact under greedy decoding). Runs:
//
// - generate: two generateText turns, the second with the first's `response.messages`;
// - chained: the same two turns, the second sending only its message and the first's id
//   (`providerOptions.openai.previousResponseId`);
// - stream: the same two turns with streamText;
// - tools: one generateText with a get_weather tool the SDK executes, two steps;
// - structured: `output: Output.object({schema})` (sent as `text.format` json_schema), through
//   generateText and through streamText;
// - logprobs: `providerOptions.openai.logprobs` true (the SDK sends `top_logprobs: 20`) through
//   generateText and 3 through streamText, the SDK's parsed logprobs read from
//   `providerMetadata.openai.logprobs`;
// - reasoning / reasoning-unstored: two generateText turns on the fixture model's reasoning
//   prompt, its reasoning shown from summaries (`reasoningSummary`, `forceReasoning` for a model
//   id the SDK does not know), with `store` true (the second turn sends references) and false
//   (the first asks for `reasoning.encrypted_content`, the second resends the sealed item).
//
// Prints one JSON object on stdout: each turn's text, finish reason, and the input items of the
// request the SDK sent (`request.body`). Any error: its message (and an API error's status and
// body) on stderr, exit status 1.

import { parseArgs } from "node:util";

const { values: args } = parseArgs({
  options: {
    "base-url": { type: "string" },
    model: { type: "string" },
    "api-key": { type: "string", default: process.env.RESQ_TEST_API_KEY ?? "sk-unused" },
    only: { type: "string" },
    sdk: { type: "string", default: "7" },
  },
});
if (!args["base-url"] || !args.model) {
  console.error("usage: node vercel_chat.mjs --base-url URL --model NAME [--api-key KEY] [--only chained,generate,stream,tools,structured,logprobs,reasoning,reasoning-unstored] [--sdk 7|6]");
  process.exit(2);
}
const PACKAGES = { 7: ["ai", "@ai-sdk/openai"], 6: ["ai-v6", "@ai-sdk/openai-v3"] };
if (!PACKAGES[args.sdk]) {
  console.error(`--sdk ${args.sdk}: known majors are ${Object.keys(PACKAGES).join(", ")}`);
  process.exit(2);
}
const [aiPackage, providerPackage] = PACKAGES[args.sdk];
// The SDK's warnings (e.g. a setting it drops for a reasoning model) go to stderr: ai 6 prints
// them on stdout, which carries this script's JSON.
globalThis.AI_SDK_LOG_WARNINGS = ({ warnings }) => console.error(`AI SDK warnings: ${JSON.stringify(warnings)}`);
const { generateText, jsonSchema, Output, stepCountIs, streamText, tool } = await import(aiPackage);
const { createOpenAI } = await import(providerPackage);

const openai = createOpenAI({ baseURL: args["base-url"], apiKey: args["api-key"] });
const model = openai.responses(args.model);
// `include.requestBody`: ai 7 keeps the request body only when asked (ai 6 kept it by default and
// ignores the option); the tests read the input items the SDK sent from it.
const settings = { temperature: 0, maxRetries: 0, include: { requestBody: true } };

// The request body the SDK sent, parsed (the SDK keeps the body as sent).
function sentBody(request) {
  return typeof request?.body === "string" ? JSON.parse(request.body) : request?.body;
}

// Its input items.
function sentInput(request) {
  return sentBody(request)?.input ?? null;
}

function summary(result, request) {
  return {
    text: result.text,
    finishReason: result.finishReason,
    responseId: result.response?.id ?? null,
    input: sentInput(request ?? result.request),
  };
}

async function generateChat() {
  const messages = [{ role: "user", content: "My name is Ada." }];
  const first = await generateText({ model, messages, ...settings });
  messages.push(...first.response.messages, { role: "user", content: "What is my name?" });
  const second = await generateText({ model, messages, ...settings });
  return { turn1: summary(first), turn2: summary(second) };
}

async function streamChat() {
  const turn = async (messages) => {
    let failure = null;
    const result = streamText({ model, messages, ...settings, onError: ({ error }) => { failure = error; } });
    let text = "";
    for await (const delta of result.textStream) text += delta;
    if (failure) throw failure;
    const [response, request, finishReason] = await Promise.all([result.response, result.request, result.finishReason]);
    return { text, finishReason, responseId: response.id, input: sentInput(request), messages: response.messages };
  };
  const messages = [{ role: "user", content: "My name is Ada." }];
  const first = await turn(messages);
  messages.push(...first.messages, { role: "user", content: "What is my name?" });
  const second = await turn(messages);
  delete first.messages;
  delete second.messages;
  return { turn1: first, turn2: second };
}

async function toolChat() {
  const calls = [];
  const getWeather = tool({
    description: "Get the current weather for a city.",
    // The fixture model knows this schema exactly as written (key order included).
    inputSchema: jsonSchema({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
    execute: async ({ city }) => {
      calls.push(city);
      return "22C and sunny";
    },
  });
  const result = await generateText({
    model,
    messages: [{ role: "user", content: "What is the weather in Paris?" }],
    tools: { get_weather: getWeather },
    stopWhen: stepCountIs(2),
    ...settings,
  });
  return {
    text: result.text,
    finishReason: result.finishReason,
    executed: calls,
    steps: result.steps.map((step) => ({
      finishReason: step.finishReason,
      text: step.text,
      toolCalls: step.toolCalls.map((call) => ({ toolName: call.toolName, input: call.input })),
      input: sentInput(step.request),
    })),
  };
}

const WEATHER_REPORT = jsonSchema({
  type: "object",
  properties: { city: { type: "string", enum: ["Paris", "London", "Tokyo"] }, sunny: { type: "boolean" } },
  required: ["city", "sunny"],
  additionalProperties: false,
});

async function structuredAnswer() {
  const ask = { model, prompt: "What is the weather in Paris?", output: Output.object({ schema: WEATHER_REPORT }), maxOutputTokens: 64, ...settings };
  const generated = await generateText(ask);
  let failure = null;
  const streamed = streamText({ ...ask, onError: ({ error }) => { failure = error; } });
  let partials = 0;
  for await (const partial of streamed.partialOutputStream) if (partial !== undefined) partials += 1;
  if (failure) throw failure;
  const [output, finishReason, request] = await Promise.all([streamed.output, streamed.finishReason, streamed.request]);
  return {
    generate: { output: generated.output, finishReason: generated.finishReason, format: sentBody(generated.request)?.text?.format ?? null },
    stream: { output, finishReason, partials, format: sentBody(request)?.text?.format ?? null },
  };
}

// For a reasoning model the SDK drops `temperature` (with a warning), so its answers would be
// sampled at the server's default of 1: this provider's requests get `temperature: 0` added on
// the way out (a custom `fetch`, as apps use for headers or logging), for exact answers.
const greedyOpenAI = createOpenAI({
  baseURL: args["base-url"],
  apiKey: args["api-key"],
  fetch: (url, init) => {
    const body = JSON.parse(init.body);
    return fetch(url, { ...init, body: JSON.stringify({ ...body, temperature: body.temperature ?? 0 }) });
  },
});

async function reasoningChat(store) {
  const model = greedyOpenAI.responses(args.model);
  const providerOptions = { openai: { reasoningSummary: "auto", forceReasoning: true, store } };
  const messages = [{ role: "user", content: "What is 2+2? Think first." }];
  const first = await generateText({ model, messages, providerOptions, ...settings });
  messages.push(...first.response.messages, { role: "user", content: "And 3+3?" });
  // The fixture model was not trained on a second turn: any answer, kept short.
  const second = await generateText({ model, messages, providerOptions, maxOutputTokens: 32, ...settings });
  const firstBody = sentBody(first.request);
  return {
    turn1: {
      text: first.text,
      responseId: first.response?.id ?? null,
      reasoningText: first.reasoningText ?? null,
      finishReason: first.finishReason,
      store: firstBody?.store ?? null,
      include: firstBody?.include ?? null,
    },
    turn2: { finishReason: second.finishReason, input: sentInput(second.request) },
  };
}

async function logprobsAnswer() {
  const ask = (logprobs) => ({ model, prompt: "Say hello.", providerOptions: { openai: { logprobs } }, ...settings });
  const generated = await generateText(ask(true));
  let failure = null;
  const streamed = streamText({ ...ask(3), onError: ({ error }) => { failure = error; } });
  let text = "";
  for await (const delta of streamed.textStream) text += delta;
  if (failure) throw failure;
  const [metadata, request] = await Promise.all([streamed.providerMetadata, streamed.request]);
  const sent = (body) => ({ topLogprobs: body?.top_logprobs ?? null, include: body?.include ?? null });
  return {
    generate: { text: generated.text, logprobs: generated.providerMetadata?.openai?.logprobs ?? null, ...sent(sentBody(generated.request)) },
    stream: { text, logprobs: metadata?.openai?.logprobs ?? null, ...sent(sentBody(request)) },
  };
}

async function chainedChat() {
  const first = await generateText({ model, messages: [{ role: "user", content: "My name is Ada." }], ...settings });
  // Only the new message, the first turn by `previousResponseId` (the provider's option).
  const second = await generateText({
    model,
    messages: [{ role: "user", content: "What is my name?" }],
    providerOptions: { openai: { previousResponseId: first.response.id } },
    ...settings,
  });
  const body = sentBody(second.request);
  return {
    turn1: summary(first),
    turn2: { ...summary(second), previousResponseId: body?.previous_response_id ?? null },
  };
}

const runs = {
  chained: chainedChat,
  generate: generateChat,
  stream: streamChat,
  tools: toolChat,
  structured: structuredAnswer,
  logprobs: logprobsAnswer,
  reasoning: () => reasoningChat(true),
  "reasoning-unstored": () => reasoningChat(false),
};
const chosen = args.only ? args.only.split(",") : Object.keys(runs);
const results = {};
try {
  for (const name of chosen) {
    if (!runs[name]) throw new Error(`unknown run ${name}; known: ${Object.keys(runs).join(", ")}`);
    results[name] = await runs[name]();
  }
} catch (error) {
  console.error(`${error?.name ?? "Error"}: ${error?.message ?? error}`);
  if (error?.statusCode !== undefined) console.error(`status: ${error.statusCode}`);
  if (error?.responseBody !== undefined) console.error(`response body: ${error.responseBody}`);
  if (error?.requestBodyValues !== undefined) console.error(`request body: ${JSON.stringify(error.requestBodyValues)}`);
  console.error(`results so far: ${JSON.stringify(results)}`);
  process.exit(1);
}
console.log(JSON.stringify(results));
