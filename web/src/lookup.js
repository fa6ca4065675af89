// Drafts that need no model, as src/spececd/edge/lookup.py's NgramLookup drafts them (the
// same rules; tests/web/test_browser_edge.py checks the two propose the same tokens):
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

/** How many first tokens `a` and `b` share. */
export function sharedPrefix(a, b) {
  let n = 0;
  while (n < a.length && n < b.length && a[n] === b[n]) n++;
  return n;
}

/** The one-hot distribution a deterministic draft of `token` was drawn from. */
export function oneHot(token) {
  return { ids: [token], probs: [1] };
}

export const PREDICTION_MAX_NGRAM = 8; // the longest suffix of the output a prediction re-anchors on
export const PREDICTION_SLACK = 2; // prediction tokens an edit of a token or two may skip

/**
 * Where an output stands in a `prediction` of it (Predicted Outputs), as the Python edge's
 * Alignment (src/spececd/edge/lookup.py) aligns it, by the same rules (the tests compare the
 * two on random pairs): the output follows the prediction token by token; where it leaves
 * it (an edit), the alignment picks it up again where the longest suffix of the output
 * (minNgram to maxNgram tokens) occurs in the prediction, at its nearest place from where
 * the output left (forward first), or, within a token or two of the divergence, where the
 * output's token is one of the next PREDICTION_SLACK + 1 prediction tokens. `sync` follows
 * an output that grows and rolls back.
 */
/** Credit the prediction's `count` tokens before `place`, those past `frontier` only:
 * [hits, frontier] after. */
function credit(hits, frontier, place, count) {
  return [hits + Math.max(0, place - Math.max(frontier, place - count)), Math.max(frontier, place)];
}

export class Alignment {
  constructor(prediction, maxNgram = PREDICTION_MAX_NGRAM, minNgram = MIN_NGRAM) {
    if (!(minNgram >= 1 && minNgram <= maxNgram)) {
      throw new Error(`need 1 <= minNgram <= maxNgram, got ${minNgram}, ${maxNgram}`);
    }
    this.prediction = Array.from(prediction);
    this.maxNgram = maxNgram;
    this.minNgram = minNgram;
    this.output = [];
    // After output[:i]: [where the output continues in the prediction (-1: it left it),
    // where it last stood there, output tokens since it was last picked up (or since it
    // left), prediction tokens credited as appearing in the output, the prediction's place
    // past the last one credited (each credited once, in order, as a diff would)].
    this.states = [[0, 0, 0, 0, 0]];
  }

  /** Align `output` (the generated tokens), keeping what it shares with the last. */
  sync(output) {
    let kept = 0;
    while (kept < this.output.length && kept < output.length && this.output[kept] === output[kept]) kept++;
    this.output.length = kept;
    this.states.length = kept + 1;
    for (let i = kept; i < output.length; i++) {
      this.output.push(output[i]);
      this.states.push(this.step(this.states[this.states.length - 1], output[i]));
    }
  }

  /** Where the output continues in the prediction (-1: it left it). */
  get at() { return this.states[this.states.length - 1][0]; }

  /** Output tokens that followed the prediction since it was last picked up (0: it left). */
  get run() {
    const [at, , run] = this.states[this.states.length - 1];
    return at >= 0 ? run : 0;
  }

  /** Prediction tokens that appeared in the output, each counted once, in order. */
  get hits() { return this.states[this.states.length - 1][3]; }

  step([at, last, run, hits, frontier], token) {
    const prediction = this.prediction;
    if (at >= 0 && at < prediction.length && prediction[at] === token) {
      return [at + 1, at + 1, run + 1, ...credit(hits, frontier, at + 1, 1)];
    }
    const since = at >= 0 ? 1 : run + 1;
    const found = this.anchor(last);
    if (found !== null) {
      const [place, length] = found;
      return [place, place, length, ...credit(hits, frontier, place, Math.min(length, since))];
    }
    if (since <= PREDICTION_SLACK) {
      const end = Math.min(prediction.length, last + PREDICTION_SLACK + 1);
      for (let i = last; i < end; i++) {
        if (prediction[i] === token) return [i + 1, i + 1, 1, ...credit(hits, frontier, i + 1, 1)];
      }
    }
    return [-1, last, since, hits, frontier];
  }

  /** Where the output continues in the prediction by the longest suffix of it found there
   * (minNgram tokens at least), nearest from `last` (forward first), and the suffix's
   * length; null where none occurs. */
  anchor(last) {
    const text = this.output, prediction = this.prediction;
    const n = text.length;
    if (n < this.minNgram) return null;
    const reach = Math.min(this.maxNgram, n);
    let best = 0;
    const places = [];
    for (let end = 0; end < prediction.length; end++) {
      if (prediction[end] !== text[n - 1]) continue;
      let length = 1;
      while (length < reach && end - length >= 0 && prediction[end - length] === text[n - 1 - length]) {
        length++;
      }
      if (length > best) {
        best = length;
        places.length = 0;
      }
      if (length === best) places.push(end + 1);
    }
    if (best < this.minNgram) return null;
    const ahead = places.find((place) => place >= last);
    return [ahead !== undefined ? ahead : places[places.length - 1], best];
  }
}

/** Lookup over a prediction of the output: its tokens from where the output (the history
 * past `promptLen`) stands in it, none where the output has left it or reached its end. As
 * src/spececd/edge/lookup.py's PredictionLookup; `matchLen`: the alignment's run. */
export class PredictionLookup {
  constructor(prediction) {
    this.alignment = new Alignment(prediction);
    this.matchLen = 0;
  }

  propose(history, k, promptLen) {
    const alignment = this.alignment;
    alignment.sync(history.slice(promptLen));
    this.matchLen = alignment.run;
    const at = alignment.at;
    return at < 0 ? [] : alignment.prediction.slice(at, at + k);
  }
}
