// The page's draft sources, one contract: `await source.draft(history, k, settings)` gives
// {tokens, dists, lookedUp}: up to `k` tokens after `history`, in exact sampling mode the
// distribution each was drawn from (else null), and how many of the first were looked up.
// As src/spececd/edge/sources.py: lookup alone, the draft model alone, or the hybrid, which
// proposes the lookup where it matches and asks the model elsewhere. PredictedSource puts
// a prediction of the output first (Predicted Outputs), as PredictedDraft does: its blocks
// also say how many of their first tokens came from the prediction (`predicted`).
// `await source.free(history, k, settings)` gives the block where the source drafts without
// a model step (a lookup's match, a prediction the output follows), else null
// (DraftSource.free): such drafts go as far as the server's pass width. Where a source has
// them, `source.cancel()` stops a draft in flight that is no longer needed,
// `source.expect(token)` one whose first token is not `token` after that token,
// `source.warm(history)` brings a model's cache up to the history, `source.behind(history)`
// says how many tokens the model feeds before it could draft after it (edge.js drafts with
// the model only where that is at most its CATCH_UP, with k auto), and `source.stop()`
// ends all its work for a run that ended.

import { NgramLookup, PredictionLookup, oneHot } from "./lookup.js";

// The output tokens that must have followed a prediction since it was picked up for it to
// draft before the page's own source (at the start of the output, none): the Python edge's
// PREDICTION_MIN_RUN.
export const PREDICTION_MIN_RUN = 4;

/** What a deterministic draft reports: one-hot where the verifier needs distributions. */
function reported(tokens, { mode, params }) {
  return mode === "exact" && params.temperature > 0 ? tokens.map(oneHot) : null;
}

export class LookupSource {
  constructor(lookup = new NgramLookup()) {
    this.lookup = lookup;
    this.name = "lookup";
  }

  async draft(history, k, settings) {
    const tokens = this.lookup.propose(history, k);
    return { tokens, dists: reported(tokens, settings), lookedUp: tokens.length };
  }

  async free(history, k, settings) {
    const block = await this.draft(history, k, settings);
    return block.tokens.length ? block : null;
  }
}

export class ModelSource {
  constructor(drafter) {
    this.drafter = drafter;
    this.name = "model";
  }

  async draft(history, k, settings) {
    return this.drafter.draft(history, k, settings);
  }

  /** How many tokens the model feeds before it could draft after `history`. */
  behind(history) {
    return this.drafter.behind(history);
  }

  async free() {
    return null; // every token is a model step
  }

  /** Stop the draft in flight, where it can (a block drafted ahead that is not needed). */
  cancel() {
    this.drafter.cancel();
  }

  /** Stop everything the model does for this run (a draft, a warm): the run ended. */
  stop() {
    this.drafter.stop();
  }

  /** Stop the draft in flight after its first token unless that is `token`. */
  expect(token) {
    this.drafter.expect(token);
  }

  /** Bring the model's cache up to `history`, off the page's thread (rounds that drafted
   * nothing with the model). */
  warm(history) {
    this.drafter.warm(history);
  }
}

/**
 * The lookup where it matches, the model elsewhere. Any match the lookup takes (a suffix of
 * MIN_NGRAM tokens or more) goes first, where the Python edge's hybrid takes matches of 6
 * tokens or more (HYBRID_MIN_MATCH): in the page a model step costs far more than natively, and
 * short matches paid more than the model's drafts there (scripts/bench-browser.py;
 * docs/guide/browser.md). Its drafter is the model source's (cancel, expect, warm, stop).
 */
export class HybridSource extends ModelSource {
  constructor(drafter) {
    super(drafter);
    this.lookup = new LookupSource();
    this.name = "hybrid";
  }

  async draft(history, k, settings) {
    return (await this.free(history, k, settings)) || super.draft(history, k, settings);
  }

  async free(history, k, settings) {
    return this.lookup.free(history, k, settings);
  }
}

export class PredictedSource {
  /** `prediction`: the prediction's token ids; `own`: the page's source (lookup, model or
   * hybrid), which drafts where the prediction does not. */
  constructor(prediction, own, minRun = PREDICTION_MIN_RUN) {
    this.prediction = new PredictionLookup(prediction);
    this.own = own;
    this.minRun = minRun;
    this.name = own.name;
  }

  /** The prediction's tokens from where the output stands in it, where the output starts
   * or has followed it for `minRun` tokens since it picked it up again; the page's own
   * source's draft elsewhere, and the prediction's where that proposes nothing. The
   * prediction's tokens are reported one-hot, so verification stays lossless. */
  async draft(history, k, settings) {
    const [tokens, first] = this.predicted(history, k, settings);
    const predicted = () => ({ tokens, dists: reported(tokens, settings), lookedUp: tokens.length,
      predicted: tokens.length });
    if (first) return predicted();
    const own = await this.own.draft(history, k, settings);
    if (own.tokens.length || !tokens.length) return { ...own, predicted: 0 };
    return predicted(); // the page's source has nothing
  }

  cancel() {
    if (this.own.cancel) this.own.cancel();
  }

  stop() {
    if (this.own.stop) this.own.stop();
  }

  expect(token) {
    if (this.own.expect) this.own.expect(token);
  }

  warm(history) {
    if (this.own.warm) this.own.warm(history);
  }

  behind(history) {
    return this.own.behind ? this.own.behind(history) : 0;
  }

  /** The prediction's block where it drafts first, else the page's own source's free one. */
  async free(history, k, settings) {
    const [tokens, first] = this.predicted(history, k, settings);
    if (first) {
      return { tokens, dists: reported(tokens, settings), lookedUp: tokens.length,
        predicted: tokens.length };
    }
    const own = await this.own.free(history, k, settings);
    return own && { ...own, predicted: 0 };
  }

  /** The prediction's tokens after `history`, and whether they draft first there. */
  predicted(history, k, settings) {
    const tokens = this.prediction.propose(history, k, settings.promptLen);
    const first = this.prediction.matchLen >= this.minRun
      || history.length === settings.promptLen;
    return [tokens, tokens.length > 0 && first];
  }
}
