// The page's side of the draft model: a Worker (draft-worker.js) holds the model and ONNX
// Runtime Web, and this proxy gives the draft sources the contract a drafter has
// (`await drafter.draft(history, k, settings)`, sources.js). The main thread never runs the
// model: it stays free to paint and to read the socket while a block is drafted ahead.

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
    this.next = 0;
    this.pending = new Map(); // id -> {resolve, reject}
    worker.onmessage = ({ data }) => {
      const call = this.pending.get(data.id);
      if (!call) return; // failed or closed meanwhile
      this.pending.delete(data.id);
      this.drafts.delete(data.id);
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
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ id, ...message });
    });
  }

  failAll(error) {
    for (const call of this.pending.values()) call.reject(error);
    this.pending.clear();
    this.drafts.clear();
  }

  /** Stop the drafts in flight after their current step (they answer with the tokens
   * drafted so far). */
  cancel() {
    for (const id of this.drafts) this.worker.postMessage({ op: "cancel", of: id });
  }

  /** The drafts in flight stop after their first token unless it is `token` (a block
   * drafted ahead whose guess the verdict has ruled on). */
  expect(token) {
    for (const id of this.drafts) this.worker.postMessage({ op: "expect", of: id, token });
  }

  /** Bring the model's cache up to `history` in the worker (model.js's warm); a failure
   * shows at the next draft. */
  warm(history) {
    this.call({ op: "warm", history: Array.from(history) }).catch(() => {});
  }

  /** Up to `k` tokens drafted after `history` (model.js's draft, in the worker). */
  async draft(history, k, settings) {
    const { tokens, dists } = await this.call({ op: "draft", history: Array.from(history), k,
      settings });
    return { tokens, dists, lookedUp: 0 };
  }

  close() {
    this.worker.terminate();
    this.failAll(new Error("the draft worker was closed"));
  }
}
