// The page's draft worker: the draft model (model.js, with ONNX Runtime Web) runs here, off
// the page's main thread, so the page never freezes while it drafts, and the page's socket
// is read while a block is drafted ahead. Messages: {id, op: "load", base, runtime,
// wasmPaths, threads} loads the draft and answers {runtime, threads}; {id, op: "draft",
// history, k, settings} answers the model's block (model.js's draft) and the seconds it
// took. Each answer is {id, ok, result} or {id, ok: false, error}.

import { ModelDrafter, pickRuntime } from "./model.js";

let drafter = null;

async function answer({ op, ...args }) {
  if (op === "load") {
    const runtime = await pickRuntime(args.runtime);
    drafter = await ModelDrafter.load(args.base, runtime, args.wasmPaths, args.threads);
    return { runtime, threads: args.threads };
  }
  if (op === "draft") {
    if (!drafter) throw new Error("the draft worker has no model loaded");
    const t0 = performance.now();
    const block = await drafter.draft(args.history, args.k, args.settings);
    return { ...block, seconds: (performance.now() - t0) / 1000 };
  }
  throw new Error(`the draft worker has no operation ${op}`);
}

// One message at a time, in order: a draft is answered after the one before it.
let queue = Promise.resolve();
self.onmessage = ({ data }) => {
  queue = queue.then(() => answer(data)).then(
    (result) => self.postMessage({ id: data.id, ok: true, result }),
    (exc) => self.postMessage({ id: data.id, ok: false, error: String(exc?.message || exc) }));
};
