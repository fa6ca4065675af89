// The page's proxy of the draft worker (web/src/drafter.js) without a browser: what it
// knows of the model's cache (`behind`), its warms sent only where needed, its cancels; and
// the generation's rule that, with k auto, a model far behind the history drafts nothing
// while it catches up.
import assert from "node:assert/strict";
import { test } from "node:test";

import { WorkerDrafter } from "../src/drafter.js";
import { CATCH_UP, generate } from "../src/edge.js";
import { ModelSource } from "../src/sources.js";

/** A worker that records what the page posts; `reply(id, result)` answers a call. */
function fakeWorker() {
  const worker = { sent: [], postMessage(message) { this.sent.push(message); }, terminate() {} };
  worker.reply = async (id, result) => {
    worker.onmessage({ data: { id, ok: true, result } });
    await new Promise((resolve) => setImmediate(resolve)); // the proxy's handlers run
  };
  return worker;
}

test("the proxy knows how far the model is behind a history, calls in flight included", async () => {
  const worker = fakeWorker();
  const drafter = new WorkerDrafter(worker);
  const prompt = Array.from({ length: 40 }, (_, i) => i);
  assert.equal(drafter.behind(prompt), 40);
  drafter.warm(prompt);
  assert.equal(worker.sent.length, 1);
  assert.equal(drafter.behind(prompt), 40); // the warm feeds them all, still in flight
  drafter.warm(prompt); // nothing more to feed: not sent again
  assert.equal(worker.sent.length, 1);
  await worker.reply(worker.sent[0].id, 40);
  assert.equal(drafter.behind([...prompt, 7]), 1);

  const drafted = drafter.draft([...prompt, 7], 3, {});
  assert.equal(drafter.behind([...prompt, 7]), 1); // the draft in flight feeds the 7
  await worker.reply(worker.sent[1].id, { tokens: [8, 9, 10], dists: null });
  assert.deepEqual((await drafted).tokens, [8, 9, 10]);
  // Its cache holds every drafted token but the last: a verdict that kept all three and
  // added one leaves two to feed.
  assert.equal(drafter.behind([...prompt, 7, 8, 9, 10, 11]), 2);
  assert.equal(drafter.behind([...prompt, 7, 99]), 1); // a rejection: from where it differs
});

test("one warm at a time: those asked meanwhile become one, of the newest history", async () => {
  const worker = fakeWorker();
  const drafter = new WorkerDrafter(worker);
  const history = Array.from({ length: 50 }, (_, i) => i);
  drafter.warm(history.slice(0, 40));
  drafter.warm(history.slice(0, 45));
  drafter.warm(history);
  assert.equal(worker.sent.length, 1);
  await worker.reply(worker.sent[0].id, 40);
  assert.deepEqual(worker.sent.slice(1).map((m) => [m.op, m.history.length]), [["warm", 50]]);
  await worker.reply(worker.sent[1].id, 50);
  assert.equal(drafter.behind(history), 0);
  // Stopped, a run's warm asked meanwhile is not sent.
  drafter.warm([...history, 1, 2]);
  drafter.warm([...history, 1, 2, 3]);
  drafter.stop();
  await worker.reply(worker.sent[2].id, 52);
  assert.deepEqual(worker.sent.slice(3).map((m) => m.op), ["cancel"]);
});

test("a warm stopped early leaves the proxy knowing the cache holds only its start", async () => {
  const worker = fakeWorker();
  const drafter = new WorkerDrafter(worker);
  const history = Array.from({ length: 100 }, (_, i) => i);
  drafter.warm(history);
  drafter.stop();
  assert.deepEqual(worker.sent.slice(1), [{ op: "cancel", of: worker.sent[0].id }]);
  await worker.reply(worker.sent[0].id, 32); // one forward of 32 tokens, then stopped
  assert.equal(drafter.behind(history), 68);
  drafter.cancel(); // drafts only: no warm is in flight, nothing is posted
  assert.equal(worker.sent.length, 2);
});

/** A verifier whose greedy target writes history.length % 7 next, as a link (the page's
 * Link contract: exchange(session, makeFrame)); it records each round's drafted tokens. */
function fakeLink() {
  const target = (history) => history.length % 7;
  const link = { rounds: [], drop() {} };
  link.exchange = async (session, makeFrame) => {
    if (makeFrame === null) return { maxContext: 4096, maxDraft: 8, width: 64 };
    session.draft = (history, tokens) => ({ history: [...history], tokens: [...tokens] });
    const { history, tokens } = makeFrame(false);
    link.rounds.push(tokens);
    let n = 0;
    while (n < tokens.length && tokens[n] === target([...history, ...tokens.slice(0, n)])) n++;
    return { numAccepted: n, nextToken: target([...history, ...tokens.slice(0, n)]),
      verifyS: 0, verified: tokens.length };
  };
  return link;
}

/** A model source whose drafter is `lag` tokens behind any history and drafts the target's
 * tokens; it records its calls. */
function laggingModel(lag) {
  const calls = [];
  const drafter = {
    behind: () => lag.value,
    warm: (history) => calls.push(["warm", history.length]),
    draft: async (history, k) => {
      calls.push(["draft", history.length, k]);
      const tokens = [];
      for (let i = 0; i < k; i++) tokens.push((history.length + i) % 7);
      return { tokens, dists: null, lookedUp: 0 };
    },
    cancel() {}, expect() {}, stop() {},
  };
  return [new ModelSource(drafter), calls];
}

const OPTIONS = { fingerprint: "", authToken: "", mode: "exact", maxSupport: 64,
  params: { maxTokens: 24, temperature: 0, topK: 0, topP: 1, seed: 0, stopIds: [] } };

test("with k auto, a model far behind the history drafts nothing and catches up", async () => {
  const lag = { value: CATCH_UP + 1 };
  const [source, calls] = laggingModel(lag);
  const link = fakeLink();
  const run = await generate(link, [3, 1, 4], { ...OPTIONS, k: "auto", source, ahead: true });
  assert.deepEqual(run.tokens, Array.from({ length: 24 }, (_, i) => (3 + i) % 7));
  assert.ok(link.rounds.every((tokens) => tokens.length === 0));
  assert.ok(calls.length > 0 && calls.every(([op]) => op === "warm"));

  lag.value = CATCH_UP; // close enough: it drafts (and its drafts are the target's)
  const close = fakeLink();
  await generate(close, [3, 1, 4], { ...OPTIONS, k: "auto", source, ahead: true });
  assert.ok(close.rounds.some((tokens) => tokens.length > 0));
  assert.ok(calls.some(([op]) => op === "draft"));
});

test("with a fixed k the model drafts every round, however far behind", async () => {
  const [source, calls] = laggingModel({ value: 1000 });
  const link = fakeLink();
  await generate(link, [3, 1, 4], { ...OPTIONS, k: 3, source, ahead: false });
  // Every round but the last (cut to the tokens left) drafts 3.
  assert.ok(link.rounds.length > 1 && link.rounds.slice(0, -1).every((t) => t.length === 3));
  assert.ok(calls.every(([op]) => op === "draft"));
});
