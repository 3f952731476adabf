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
// - stream: the same two turns with streamText;
// - tools: one generateText with a get_weather tool the SDK executes, two steps;
// - structured: `output: Output.object({schema})` (sent as `text.format` json_schema), through
//   generateText and through streamText.
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
  console.error("usage: node vercel_chat.mjs --base-url URL --model NAME [--api-key KEY] [--only generate,stream,tools,structured] [--sdk 7|6]");
  process.exit(2);
}
const PACKAGES = { 7: ["ai", "@ai-sdk/openai"], 6: ["ai-v6", "@ai-sdk/openai-v3"] };
if (!PACKAGES[args.sdk]) {
  console.error(`--sdk ${args.sdk}: known majors are ${Object.keys(PACKAGES).join(", ")}`);
  process.exit(2);
}
const [aiPackage, providerPackage] = PACKAGES[args.sdk];
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

const runs = { generate: generateChat, stream: streamChat, tools: toolChat, structured: structuredAnswer };
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
