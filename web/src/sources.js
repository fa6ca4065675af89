// The page's draft sources, one contract: `await source.draft(history, k, settings)` gives
// {tokens, dists, lookedUp}: up to `k` tokens after `history`, in exact sampling mode the
// distribution each was drawn from (else null), and how many of the first were looked up.
// As src/spececd/edge/sources.py: lookup alone, the draft model alone, or the hybrid, which
// proposes the lookup where it matches a suffix of at least HYBRID_MIN_MATCH tokens and asks
// the model elsewhere.

import { NgramLookup, oneHot } from "./lookup.js";

export const HYBRID_MIN_MATCH = 6;

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
}

export class ModelSource {
  constructor(drafter) {
    this.drafter = drafter;
    this.name = "model";
  }

  async draft(history, k, settings) {
    return this.drafter.draft(history, k, settings);
  }
}

export class HybridSource {
  constructor(drafter, minMatch = HYBRID_MIN_MATCH) {
    this.drafter = drafter;
    this.lookup = new NgramLookup(minMatch);
    this.minMatch = minMatch;
    this.name = "hybrid";
  }

  async draft(history, k, settings) {
    const tokens = this.lookup.propose(history, k);
    if (this.lookup.matchLen < this.minMatch || !tokens.length) {
      return this.drafter.draft(history, k, settings);
    }
    return { tokens, dists: reported(tokens, settings), lookedUp: tokens.length };
  }
}
