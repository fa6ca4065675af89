// The page's side of the draft model: a Worker (draft-worker.js) holds the model and ONNX
// Runtime Web, and this proxy gives the draft sources the contract a drafter has
// (`await drafter.draft(history, k, settings)`, sources.js). The main thread never runs the
// model: it stays free to paint and to read the socket while a block is drafted ahead.
// It also keeps what the model's cache will hold once the calls sent are answered, so that
// a source can tell how far the model is behind a history (`behind`) without asking it.

import { sharedPrefix } from "./lookup.js";

export class WorkerDrafter {
  /** Start a worker and load the draft at `base` on `runtimeAsked` ("auto", "wasm" or
   * "webgpu") and `threads` WebAssembly threads (undefined: ONNX Runtime Web's own choice,
   * several only where the page is cross-origin isolated, as `spececd serve` serves it);
   * `wasmPaths`: where ONNX Runtime's WebAssembly files are. */
  static async load(base, runtimeAsked, wasmPaths, threads) {
    const worker = new Worker(new URL("./draft-worker.js", import.meta.url), { type: "module" });
    const drafter = new WorkerDrafter(worker);
    try {
      const loaded = await drafter.call({ op: "load", base, runtime: runtimeAsked, wasmPaths,
        threads });
      Object.assign(drafter, { runtime: loaded.runtime, threads: loaded.threads,
        isolated: loaded.isolated, kept: loaded.kept });
    } catch (exc) {
      worker.terminate();
      throw exc;
    }
    return drafter;
  }

  constructor(worker) {
    this.worker = worker;
    this.runtime = null;
    this.threads = 1;
    this.isolated = false; // whether the worker is cross-origin isolated
    this.kept = []; // the files its load read from Cache Storage
    this.drafts = new Set(); // the ids of drafts not yet answered
    this.warms = new Set(); // and of warms
    this.next = 0;
    this.pending = new Map(); // id -> {resolve, reject}
    this.mirror = []; // the ids the model's cache will hold once the calls sent are answered
    this.feeding = 0; // the tokens the calls in flight feed the model
    this.warming = false; // whether a warm is in flight (one at a time)
    this.wanted = null; // the history the next warm brings the cache to, sent after it
    worker.onmessage = ({ data }) => {
      const call = this.pending.get(data.id);
      if (!call) return; // failed or closed meanwhile
      this.pending.delete(data.id);
      this.drafts.delete(data.id);
      this.warms.delete(data.id);
      if (data.ok) call.resolve(data.result);
      else call.reject(new Error(data.error));
    };
    worker.onerror = (event) => {
      const error = new Error(`the draft worker failed: ${event.message || "no message"}`);
      this.failAll(error);
    };
  }

  call(message) {
    const id = this.next++;
    if (message.op === "draft") this.drafts.add(id);
    if (message.op === "warm") this.warms.add(id);
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ id, ...message });
    });
  }

  failAll(error) {
    for (const call of this.pending.values()) call.reject(error);
    this.pending.clear();
    this.drafts.clear();
    this.warms.clear();
  }

  /** Stop the drafts in flight after their current step (they answer with the tokens
   * drafted so far). */
  cancel() {
    for (const id of this.drafts) this.worker.postMessage({ op: "cancel", of: id });
  }

  /** Stop everything in flight: the drafts, and the warms after their current forward (a
   * run ended: nobody needs them). */
  stop() {
    this.cancel();
    this.wanted = null;
    for (const id of this.warms) this.worker.postMessage({ op: "cancel", of: id });
  }

  /** The drafts in flight stop after their first token unless it is `token` (a block
   * drafted ahead whose guess the verdict has ruled on). */
  expect(token) {
    for (const id of this.drafts) this.worker.postMessage({ op: "expect", of: id, token });
  }

  /** The tokens the model feeds before a draft after `history` could start: what the calls
   * in flight feed, and what its cache would then lack of `history`. */
  behind(history) {
    return this.feeding + this.lacks(history);
  }

  /** The tokens of `history` the model's cache will lack once the calls sent are answered. */
  lacks(history) {
    return history.length - sharedPrefix(this.mirror, history);
  }

  /** Bring the model's cache up to `history` in the worker (model.js's warm), unless the
   * calls sent already do; one warm at a time: asked while one is in flight, the newest
   * history asked is warmed when it answers. A failure shows at the next draft. */
  warm(history) {
    const feed = this.lacks(history);
    if (feed <= 0) return;
    if (this.warming) {
      this.wanted = Array.from(history);
      return;
    }
    const sent = Array.from(history);
    this.mirror = sent;
    this.feeding += feed;
    this.warming = true;
    this.call({ op: "warm", history: sent }).then(
      // Stopped before the end (cancelled): its cache holds only the start.
      (held) => { if (this.mirror === sent) this.mirror = sent.slice(0, held); },
      () => {}).finally(() => {
      this.feeding -= feed;
      this.warming = false;
      const wanted = this.wanted;
      this.wanted = null;
      if (wanted) this.warm(wanted);
    });
  }

  /** Up to `k` tokens drafted after `history` (model.js's draft, in the worker). */
  async draft(history, k, settings) {
    const sent = Array.from(history);
    // The model feeds at least the history's last token (its logits are the first draft's).
    const feed = Math.max(1, this.lacks(sent));
    this.mirror = sent;
    this.feeding += feed;
    try {
      const { tokens, dists } = await this.call({ op: "draft", history: sent, k, settings });
      // Its cache holds the history and every drafted token but the last (unless a later
      // call has been sent: that one's history is what it will hold).
      if (this.mirror === sent) this.mirror = sent.concat(tokens.slice(0, -1));
      return { tokens, dists, lookedUp: 0 };
    } finally {
      this.feeding -= feed;
    }
  }

  close() {
    this.worker.terminate();
    this.failAll(new Error("the draft worker was closed"));
  }
}
