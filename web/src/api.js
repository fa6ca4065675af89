// The playground's OpenAI API client (`spececd api`): the model's name, and one request
// streamed as server-sent events, each chunk's text with the `spececd` object that says
// where its tokens came from. Same origin only: the page `spececd api` serves.

export class ApiError extends Error {}

/** The request's headers: JSON, and the API key where one is given. */
export function headers(apiKey) {
  const h = { "content-type": "application/json" };
  if (apiKey) h.authorization = `Bearer ${apiKey}`;
  return h;
}

/** The server's own message where it answered in OpenAI's error shape. */
export async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  if (response.status === 401) message += " (enter it in the API key field)";
  return new ApiError(message);
}

/** The id of the first model the server lists. */
export async function modelName(apiKey) {
  const response = await fetch("/v1/models", { headers: headers(apiKey) });
  if (response.status === 404 || response.status === 426) {  // 426: `spececd serve`'s port
    throw new ApiError("this server has no OpenAI API at /v1: start `spececd api`, or " +
      "choose the browser edge");
  }
  if (!response.ok) throw await failure(response);
  const body = await response.json();
  if (!body.data || !body.data.length) throw new ApiError("the server lists no model");
  return body.data[0].id;
}

/**
 * Server-sent events of `body` (a stream of bytes): each `data:` payload, parsed, until
 * `data: [DONE]`; an `error` payload (a failure after the stream began) is thrown, as is a
 * stream that ends before [DONE].
 */
export async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new ApiError("the stream ended before [DONE]");
    buffer += value;
    let match;
    while ((match = /\r?\n\r?\n/.exec(buffer)) !== null) {
      const block = buffer.slice(0, match.index);
      buffer = buffer.slice(match.index + match[0].length);
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new ApiError(payload.error.message || "generation failed");
      yield payload;
    }
  }
}

/**
 * A streamed request's body from the form's fields: {model, maxTokens, temperature, seed
 * (undefined: the server's), k ("auto", a number, or undefined: the server's), schema (JSON
 * text, or ""), prediction (text, or "")}. The schema
 * goes as text: the server checks it, and a bad one comes back as a 400 that says why.
 */
export function requestBody(fields) {
  const body = { model: fields.model, stream: true, stream_options: { include_usage: true },
    temperature: fields.temperature };
  if (fields.maxTokens !== undefined) body.max_tokens = fields.maxTokens;
  if (fields.k !== undefined) body.k = fields.k;
  if (Number.isFinite(fields.seed)) body.seed = fields.seed;
  if (fields.schema.trim()) body.structured_outputs = { json: fields.schema.trim() };
  if (fields.prediction.trim()) body.prediction = { type: "content", content: fields.prediction };
  return body;
}

/**
 * Streams one request to `path`; `onChunk(piece, info, finish)` gets each choice's text
 * (`info`: its `spececd` object, or undefined), and `onUsage(usage, speculative, finish)`
 * the closing usage chunk. Returns the text.
 */
export async function stream(path, body, { apiKey, signal }, onChunk, onUsage) {
  const response = await fetch(path, {
    method: "POST", headers: headers(apiKey), body: JSON.stringify(body), signal });
  if (!response.ok) throw await failure(response);
  let text = "";
  let finish = null;
  for await (const chunk of events(response.body)) {
    if (chunk.usage && chunk.speculative) onUsage(chunk.usage, chunk.speculative, finish);
    for (const choice of chunk.choices) {
      const piece = choice.delta ? (choice.delta.content || "") : (choice.text || "");
      finish = choice.finish_reason || finish;
      onChunk(piece, choice.spececd, finish);
      text += piece;
    }
  }
  return text;
}

/** A run's statistics and details line from its closing usage chunk. */
export function summary(usage, spec, finish, predicted) {
  const parts = spec.cloud_only
    ? [`verify ${spec.verify_s.toFixed(2)} s`]
    : [`${spec.num_drafts} rounds`, `${spec.num_accepted_tokens}/${spec.num_draft_tokens}` +
       " drafts accepted", `draft ${spec.draft_s.toFixed(2)} s`,
       `verify ${spec.verify_s.toFixed(2)} s`, `network ${spec.network_s.toFixed(2)} s`];
  if (spec.forced_tokens) parts.push(`${spec.forced_tokens} forced by the schema`);
  if (spec.lookup_drafted) {
    parts.push(`${spec.lookup_accepted}/${spec.lookup_drafted} looked-up drafts accepted`);
  }
  const counted = usage.completion_tokens_details;
  const prediction = predicted && counted ? { accepted: counted.accepted_prediction_tokens,
    rejected: counted.rejected_prediction_tokens } : null;
  if (prediction) {
    parts.push(`prediction: ${prediction.accepted} tokens in the reply, ` +
               `${prediction.rejected} not`);
  }
  if (spec.fallback) parts.push(`fallback: ${spec.fallback_tokens} unverified tokens`);
  if (finish) parts.push(`finish: ${finish}`);
  return { tps: spec.tokens_per_s, acceptance: spec.acceptance_rate,
    mal: spec.mean_acceptance_length, tokens: usage.completion_tokens, prediction,
    details: parts.join(" · ") };
}
