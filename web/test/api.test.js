// The playground's API client without a browser: server-sent events split anywhere, the
// request body from the form's fields, and a run's summary from its usage chunk.
import { test } from "node:test";
import assert from "node:assert/strict";
import { ApiError, events, requestBody, summary } from "../src/api.js";

/** A byte stream of `text` cut into the given pieces' lengths (the rest in one). */
function stream(text, cuts) {
  const bytes = new TextEncoder().encode(text);
  return new ReadableStream({
    start(controller) {
      let at = 0;
      for (const cut of cuts) {
        controller.enqueue(bytes.slice(at, at + cut));
        at += cut;
      }
      controller.enqueue(bytes.slice(at));
      controller.close();
    },
  });
}

async function all(body) {
  const got = [];
  for await (const payload of events(body)) got.push(payload);
  return got;
}

const SSE = 'data: {"a": 1}\n\n: a comment\n\ndata: {"b":\ndata: "é"}\r\n\r\ndata: [DONE]\n\n';

test("events are parsed wherever the stream is cut, CRLF and multi-line data too", async () => {
  const whole = await all(stream(SSE, []));
  assert.deepEqual(whole, [{ a: 1 }, { b: "é" }]);
  const bytes = new TextEncoder().encode(SSE).length;
  for (let cut = 1; cut < bytes; cut += 3) {  // inside "é" too: UTF-8 decoded as a stream
    assert.deepEqual(await all(stream(SSE, [cut, 2, 5])), whole);
  }
});

test("an error event and a stream without [DONE] are thrown", async () => {
  await assert.rejects(all(stream('data: {"error": {"message": "boom"}}\n\n', [])),
    (exc) => exc instanceof ApiError && exc.message === "boom");
  await assert.rejects(all(stream('data: {"a": 1}\n\n', [])), /ended before \[DONE\]/);
});

test("the request body takes what the form gives and leaves out what it leaves empty", () => {
  const fields = { model: "m", maxTokens: 8, temperature: 0, seed: undefined, k: undefined,
    schema: "  ", prediction: " " };
  assert.deepEqual(requestBody(fields), { model: "m", stream: true,
    stream_options: { include_usage: true }, max_tokens: 8, temperature: 0 });
  assert.equal(requestBody({ ...fields, k: "auto" }).k, "auto");
  const full = requestBody({ ...fields, seed: 3, k: 4, schema: ' {"type": "object"} ',
    prediction: "x = 1\n" });
  assert.equal(full.seed, 3);
  assert.equal(full.k, 4);
  assert.deepEqual(full.structured_outputs, { json: '{"type": "object"}' });
  assert.deepEqual(full.prediction, { type: "content", content: "x = 1\n" });
});

test("a summary counts the prediction only where one was sent", () => {
  const usage = { completion_tokens: 10, completion_tokens_details:
    { accepted_prediction_tokens: 7, rejected_prediction_tokens: 2 } };
  const spec = { cloud_only: false, num_drafts: 3, num_accepted_tokens: 7, num_draft_tokens: 9,
    draft_s: 0.01, verify_s: 0.02, network_s: 0, tokens_per_s: 50, acceptance_rate: 0.78,
    mean_acceptance_length: 3.3, forced_tokens: 0, lookup_drafted: 0 };
  const shown = summary(usage, spec, "length", true);
  assert.deepEqual(shown.prediction, { accepted: 7, rejected: 2 });
  assert.match(shown.details, /^3 rounds · 7\/9 drafts accepted .*prediction: 7 tokens in the reply, 2 not · finish: length$/);
  assert.equal(summary(usage, spec, "stop", false).prediction, null);
  assert.equal(summary(usage, { ...spec, cloud_only: true }, null, false).details,
    "verify 0.02 s");
});
