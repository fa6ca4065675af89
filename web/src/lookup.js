// Drafts that need no model, as src/spececd/edge/lookup.py's NgramLookup drafts them (the
// same rules; tests/web/test_lookup_parity.py checks the two propose the same tokens):
// the longest suffix of the history, minNgram to maxNgram tokens, found at its most recent
// earlier place, proposes the tokens that followed it, continued through the text it
// proposes where that runs out. Deterministic, so in exact mode each token is reported
// one-hot.

export const MAX_NGRAM = 4;
export const MIN_NGRAM = 2;

/** Where the continuation of the longest suffix of `text` (minN to maxN tokens) starts at
 * its most recent earlier occurrence, and the suffix's length; null when none of minN
 * tokens occurs earlier. */
export function match(text, minN, maxN) {
  const size = text.length;
  if (size <= minN) return null;
  const last = text[size - 1];
  let best = 0, bestEnd = -1;
  const reach = Math.min(maxN, size - 1);
  for (let end = 0; end < size - 1; end++) {
    if (text[end] !== last) continue;
    let length = 1;
    while (length < reach && end - length >= 0 && text[end - length] === text[size - 1 - length]) {
      length++;
    }
    if (length >= best) { // ties: the most recent
      best = length;
      bestEnd = end;
    }
  }
  if (best < minN) return null;
  return [bestEnd + 1, best];
}

export class NgramLookup {
  constructor(maxNgram = MAX_NGRAM, minNgram = MIN_NGRAM) {
    if (!(minNgram >= 1 && minNgram <= maxNgram)) {
      throw new Error(`need 1 <= minNgram <= maxNgram, got ${minNgram}, ${maxNgram}`);
    }
    this.maxNgram = maxNgram;
    this.minNgram = minNgram;
    this.matchLen = 0;
  }

  /** Up to `k` tokens that followed the longest matching suffix of `history`. */
  propose(history, k) {
    const text = Array.from(history);
    const out = [];
    this.matchLen = 0;
    while (out.length < k) {
      const found = match(text, this.minNgram, this.maxNgram);
      if (found === null) break;
      const [start, n] = found;
      if (!out.length) this.matchLen = n;
      const more = text.slice(start, start + k - out.length);
      out.push(...more);
      text.push(...more);
    }
    return out;
  }
}

/** The one-hot distribution a deterministic draft of `token` was drawn from. */
export function oneHot(token) {
  return { ids: [token], probs: [1] };
}
